"""``unmask distill`` on the command line: its refusals are one line naming the field or flag,
before any work (the runs themselves: tests/pipeline/training/test_distillation.py)."""

from __future__ import annotations

import pytest

from tests.support.cli_refusals import one_line_error
from tests.support.train_helpers import write_config


@pytest.mark.parametrize(("overrides", "names"), [
    (["--model.process", "uniform", "--model.time_conditioning", "true"],
     "config field model.process = 'uniform': self-distillation supports the absorbing process only"),
    (["--model.block_size", "8"], "config field model.block_size = 8: self-distillation is built for"),
    (["--distill.end_steps", "3"], "config field distill.end_steps = 3: must be distill.start_steps = 1024 halved"),
    (["--distill.divergence", "kl"], "flag --distill.divergence = 'kl': choose one of ['reverse_kl', 'forward_kl'"),
    (["--train.max_steps", "5"], "config field train.max_steps = 5: a distillation is 7 rounds of"),
])
def test_a_refused_process_or_option_ends_unmask_distill_in_one_line(capsys, tmp_path, overrides, names):
    config = write_config(tmp_path / "distill.yaml")
    err = one_line_error(capsys, "distill", str(tmp_path / "teacher"), "--config", str(config), "--data",
                         str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"), *overrides)
    assert names in err
    assert not (tmp_path / "run").exists()


def test_unmask_train_refuses_a_config_that_enables_distillation(capsys, tmp_path):
    config = write_config(tmp_path / "distill.yaml", {"distill": {"enabled": True}})
    err = one_line_error(capsys, "train", "--config", str(config), "--data", str(tmp_path / "data"), "--run-dir",
                         str(tmp_path / "run"))
    assert "config field distill.enabled = true: `unmask distill TEACHER` starts a distillation" in err


def test_print_config_shows_the_distillation_unmask_distill_runs(capsys, tmp_path):
    from tests.support.cli_runner import unmask_in_process

    config = write_config(tmp_path / "distill.yaml", {"distill": {"start_steps": 64, "round_steps": 10}})
    assert unmask_in_process(["distill", "teacher", "--config", str(config), "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "max_steps: 30\n" in printed and "enabled: true\n" in printed
