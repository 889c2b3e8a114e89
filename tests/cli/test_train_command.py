"""`unmask train` checks its config, --data and --run-dir before any work, each refused in one
message without a traceback (exit 2), and creates no run directory."""

from __future__ import annotations

from tests.support.cli_runner import run_unmask


def test_bad_config_fails_on_the_command_line_before_any_work(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  ema_decay: 1.5\n")
    run_dir = tmp_path / "run"
    proc = run_unmask(["train", "--config", str(bad), "--data", str(tmp_path), "--run-dir", str(run_dir)])
    assert proc.returncode == 2
    assert "train.ema_decay = 1.5: must lie in [0, 1)" in proc.stderr
    assert not run_dir.exists()
