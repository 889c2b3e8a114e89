"""SIGTERM during training (``pipeline.training.signals``): a preemption, not a failure. The run
writes a checkpoint at the next step boundary, exits 75 (EX_TEMPFAIL, which schedulers retry),
and its resume continues exactly."""

from __future__ import annotations

import json
import signal

import pytest

from orchestration.exit_codes import PREEMPTED
from tests.support.train_helpers import run_train, run_until_stall, write_config


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_resume_continues_exactly(tmp_path, shards, reference_runs):
    config = write_config(tmp_path / "c.yaml", {"train": {"zero_stage": 1}})
    run_dir = tmp_path / "run"
    stopped = run_until_stall(run_dir, shards, config, stall_after=4, stop=signal.SIGTERM)
    # Not finished, not failed: EX_TEMPFAIL, so that a scheduler runs it again.
    assert stopped.returncode == PREEMPTED == 75, stopped.output[-3000:]
    summary = json.loads(next(line for line in stopped.output.splitlines() if line.startswith('{"run_dir"')))
    assert summary["preempted"] is True and summary["step"] == 4
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000004"
    assert not list((run_dir / "checkpoints").glob("*.py")), "DeepSpeed's unpickling recovery scripts"
    resumed = run_train(run_dir, shards, config)
    assert resumed.losses() == reference_runs[1, 1].losses()
