"""SIGTERM during training (``pipeline.training.signals``): a preemption, not a failure. The run
writes a checkpoint at the next step boundary, exits 75 (EX_TEMPFAIL, which schedulers retry),
and its resume continues exactly."""

from __future__ import annotations

import json
import signal

import pytest

from orchestration.exit_codes import PREEMPTED
from tests.support.cli_runner import start_unmask
from tests.support.s3_server import S3Server
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


@pytest.mark.slow
def test_sigterm_while_a_read_retries_an_unreachable_store_checkpoints_and_exits_75(tmp_path, tinyshakespeare_shards):
    """The store goes down mid-run and a read (a batch's or the validation's) retries for up to 10 min;
    SIGTERM then ends the wait at once: the last whole step is checkpointed and the command
    exits 75, well within a scheduler's grace period. It was ignored until the retries gave up."""
    server = S3Server()
    server.start()
    try:
        uri = server.upload(tinyshakespeare_shards, "shards", "tiny")
        config = write_config(tmp_path / "c.yaml", {"train": {"max_steps": 100_000}, "eval": {"every": 2},
                                                    "checkpoint": {"every": 100_000}, "data": {"cache_gb": 0}})
        run_dir = tmp_path / "run"
        proc = start_unmask(["train", "--config", str(config), "--data", uri, "--run-dir", str(run_dir)],
                            env={**server.env, "XDG_CACHE_HOME": str(tmp_path / "cache")})
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line)
                if "step 1/" in line:  # training: take the store down
                    server.stop()
                if "retry 1 in" in line:  # a read waits for the store: preempt the job now
                    proc.send_signal(signal.SIGTERM)
                    break
            rest, _ = proc.communicate(timeout=120)  # the retries alone would take 600 s
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        server.stop()  # (once down, a no-op)
    output = "".join(lines) + (rest or "")
    assert proc.returncode == PREEMPTED, output[-3000:]
    assert "stopped while retrying" in output, output[-3000:]
    summary = json.loads(next(line for line in output.splitlines() if line.startswith('{"run_dir"')))
    assert summary["preempted"] is True and summary["step"] >= 1
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step-{summary['step']:08d}"
