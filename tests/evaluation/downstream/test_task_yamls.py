"""The user's lm-eval task YAMLs (``evaluation.downstream.task_yamls``), read before lm-eval runs
their code: a broken one is named by line and column, one that names code is refused unless
allowed, and data files that match nothing are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli_refusals import one_line_error as _error
from tests.support.cli_refusals import untrained_exports

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    return untrained_exports(tmp_path_factory.mktemp("exports"))


BROKEN_TASK = "task: broken\ndataset_path: json\noutput_type: [loglikelihood\ntest_split: test\n"

CODE_TASK = """\
task: code_task
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
process_docs: !function helpers.process
doc_to_text: "{{{{text}}}}"
doc_to_target: " x"
"""


@pytest.fixture
def task_dirs(tmp_path) -> dict[str, Path]:
    data = tmp_path / "doc.jsonl"
    data.write_text(json.dumps({"text": "the cat sat"}) + "\n")
    dirs = {name: tmp_path / name for name in ("broken", "code", "missing")}
    for path in dirs.values():
        path.mkdir()
    (dirs["broken"] / "broken.yaml").write_text(BROKEN_TASK)
    (dirs["code"] / "code_task.yaml").write_text(CODE_TASK.format(data=data))
    (dirs["code"] / "helpers.py").write_text(f"open({str(tmp_path / 'RAN')!r}, 'w').close()\n"
                                             "def process(docs):\n    return docs\n")
    (dirs["missing"] / "missing.yaml").write_text(CODE_TASK.format(data=tmp_path / "nope.jsonl")
                                                  .replace("process_docs: !function helpers.process\n", ""))
    return dirs


def test_lm_eval_names_a_broken_task_yaml_s_line_and_column(exports, capsys, task_dirs, tmp_path):
    export, out = str(exports["ar"]), str(tmp_path / "report")
    where = (f"task YAML {task_dirs['broken'] / 'broken.yaml'} line 4, column 11: not valid YAML: expected ',' or "
             f"']', but got ':' (while parsing a flow sequence at line 3, column 14)")
    err = _error(capsys, "lm-eval", export, "--tasks", "broken", "--include-path", str(task_dirs["broken"]),
                 "--out", out)
    assert where in err and "unknown task" not in err
    err = _error(capsys, "lm-eval", export, "--tasks", str(task_dirs["broken"] / "broken.yaml"), "--out", out)
    assert where in err and "--download" not in err
    err = _error(capsys, "lm-eval", export, "--tasks", "missing_files", "--include-path", str(task_dirs["missing"]),
                 "--out", out)
    assert f"missing.yaml line 5, column 11: data_files '{tmp_path / 'nope.jsonl'}'" in err
    assert "matches no file" in err and "rerun with --download" not in err


def test_lm_eval_refuses_a_task_yaml_that_names_code_unless_allowed(exports, capsys, task_dirs, tmp_path):
    from evaluation.downstream.task_yamls import check_task_yamls

    err = _error(capsys, "lm-eval", str(exports["ar"]), "--tasks", "code_task", "--include-path",
                 str(task_dirs["code"]), "--out", str(tmp_path / "report"))
    assert (f"code_task.yaml line 8, column 15: '!function helpers.process' makes lm-eval import and run Python from "
            f"{task_dirs['code']}; rerun with --allow-code") in err
    assert not (tmp_path / "RAN").exists()
    check_task_yamls([str(task_dirs["code"])], [], allow_code=True)   # allowed: read, and nothing run here
    assert not (tmp_path / "RAN").exists()
