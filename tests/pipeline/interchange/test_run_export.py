"""Which export a command given a run reads (``pipeline.interchange.run_export``): the run's own
latest checkpoint. An older export of the run is exported again by the commands that report a
bound and refused by `unmask sample`; another model in RUN/export (an import, copied in) is
refused by every command; a moved run still knows its own export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.errors import UserError
from pipeline.interchange.bd3lm_import import import_bd3lm
from pipeline.interchange.export import export
from pipeline.interchange.run_export import choose_export, outdated_export
from pipeline.run_dir.layout import RunLayout
from tests.support.bd3lm_fixtures import source_copy, write_tokenizer
from tests.support.cli_refusals import one_line_error, write_text_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def run(micro_run, tmp_path) -> Path:
    """A copy of the finished 2-step run (checkpoints at steps 1 and 2), without its MLflow run."""
    copy = tmp_path / "run"
    shutil.copytree(micro_run, copy)
    RunLayout(copy).mlflow_record.unlink(missing_ok=True)
    return copy


def _step(export_dir: Path) -> int:
    return json.loads((export_dir / "config.json").read_text())["step"]


def test_an_older_export_of_the_run_is_exported_again_for_a_bound_and_refused_for_samples(run, capsys):
    export(run, step=1)
    reason = f"{run / 'export'} holds step 1, and the run's latest checkpoint is step 2"
    assert outdated_export(run).reason == reason and outdated_export(run).own
    err = one_line_error(capsys, "sample", str(run), "--num", "1", "--steps", "2", "--seq-len", "8")
    assert f"{reason}: export the latest first (`unmask export {run}`), or give {run / 'export'} to read the older " \
           f"export as it is" in err
    assert choose_export(run / "export") == run / "export" and _step(run / "export") == 1  # named: read as it is
    assert choose_export(run, refresh=True) == run / "export" and _step(run / "export") == 2
    assert outdated_export(run) is None and choose_export(run) == run / "export"


def test_a_run_without_an_export_is_exported_first_only_where_a_bound_is_reported(run, capsys):
    err = one_line_error(capsys, "sample", str(run), "--num", "1", "--steps", "2", "--seq-len", "8")
    assert f"{run}: a training run without an export; run `unmask export {run}` first" in err
    assert choose_export(run, refresh=True) == run / "export" and _step(run / "export") == 2


def test_another_model_in_the_run_s_export_is_refused_by_every_command(run, tmp_path, capsys):
    """BD3-LM's model imported elsewhere, then copied into RUN/export: no command takes it for
    the run's (the import itself refuses to write there)."""
    imported = import_bd3lm(source_copy(tmp_path, "released"), write_tokenizer(tmp_path / "tok"), tmp_path / "xo")
    shutil.copytree(imported, run / "export")
    reason = f"{run / 'export'} holds an import of bd3lm's model from {(tmp_path / 'released').resolve()}, " \
             f"not a model of the run {run}"
    text = write_text_file(tmp_path)
    for argv in (["sample", str(run), "--num", "1", "--seq-len", "8"],
                 ["sample", str(run / "export"), "--num", "1", "--seq-len", "8"],
                 ["eval", str(run), "--datasets", str(text), "--samples", "2"],
                 ["eval", str(run / "export"), "--datasets", str(text), "--samples", "2"]):
        err = one_line_error(capsys, *argv)
        assert f"{reason}; an export inside a run is taken for the run's own (its report and MLflow records): move " \
               f"it out of {run} and give its new path" in err, argv
    with pytest.raises(UserError, match="not a model of the run"):
        choose_export(run, refresh=True)
    assert not RunLayout(run).report.exists() and _step(run / "export") is None


def test_a_moved_run_still_knows_its_own_export(run, tmp_path):
    """The export names its checkpoint by the sha256 of its state file, not by its path."""
    export(run)
    moved = tmp_path / "moved"
    shutil.move(run, moved)
    assert outdated_export(moved) is None and choose_export(moved) == moved / "export"


def test_an_export_eval_makes_for_a_run_is_not_called_its_out(run, tmp_path, capsys):
    """`eval RUN --out X` writes its report to X; when RUN/export cannot be written, the refusal
    names the run's export, not --out."""
    RunLayout(run).export.write_text("a file where the export goes")
    err = one_line_error(capsys, "eval", str(run), "--datasets", str(write_text_file(tmp_path)), "--samples", "2",
                         "--out", str(tmp_path / "report"))
    refusal = err.split("; or export")[0]  # the fix after it names `unmask export RUN --out DIR`
    assert f"the run's export (written for this command) {run / 'export'}: " in refusal and "--out" not in refusal, err
