"""``unmask train --launcher ray``: Ray Train workers on a local Ray (127.0.0.1), gloo, and
a worker killed mid-run that the restarted group makes good from the latest checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.run_dir.checkpoint import resolve_checkpoint
from pipeline.run_dir.layout import RunLayout, step_tag
from tests.support.cli_runner import run_unmask, start_unmask
from tests.support.stall import MARKER
from tests.support.train_helpers import RUN_TIMEOUT_S, Run, write_config

pytestmark = pytest.mark.slow

MAX_STEPS, CHECKPOINT_EVERY, KILL_AFTER = 8, 4, 6
POLL_S = 0.2  # how often to look for the stalled worker's pid file


def _args(config: Path, data: Path, run_dir: Path, extra: list[str] = ()) -> list[str]:
    """``unmask train`` on two Ray Train workers."""
    return ["train", "--launcher", "ray", "--num-workers", "2", "--config", str(config), "--data", str(data),
            "--run-dir", str(run_dir), *extra]


def _config(tmp_path: Path) -> Path:
    return write_config(tmp_path / "micro.yaml", {
        "train": {"max_steps": MAX_STEPS}, "eval": {"every": CHECKPOINT_EVERY},
        "checkpoint": {"every": CHECKPOINT_EVERY, "keep_last": 3}})


def _kill_rank_1_when_stalled(proc: subprocess.Popen, run_dir: Path) -> None:
    """Wait until rank 1 stalls after step KILL_AFTER, then SIGKILL that worker process."""
    marker = run_dir / MARKER.format(rank=1)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not marker.is_file() or not marker.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"rank 1 never stalled (exit {proc.poll()}):\n{proc.communicate()[0][-4000:]}")
        time.sleep(POLL_S)
    os.kill(int(marker.read_text()), signal.SIGKILL)


def test_a_killed_worker_is_restarted_from_the_latest_checkpoint_with_the_same_result(tinyshakespeare_shards,
                                                                                        tmp_path):
    config = _config(tmp_path)
    calm = run_unmask(_args(config, tinyshakespeare_shards, tmp_path / "calm"), timeout=RUN_TIMEOUT_S)
    assert calm.returncode == 0, (calm.stdout + calm.stderr)[-4000:]

    run_dir, storage = tmp_path / "killed", tmp_path / "storage"
    proc = start_unmask(_args(config, tinyshakespeare_shards, run_dir,
                              ["--max-failures", "1", "--storage", str(storage)]), stall_after=KILL_AFTER)
    try:
        _kill_rank_1_when_stalled(proc, run_dir)
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]

    undisturbed, restarted = Run(0, calm.stdout, tmp_path / "calm"), Run(0, output, run_dir)
    # The restart really happened, from the checkpoint before the kill; the steps after it
    # were done twice, and are recorded once.
    assert f"resumed from {RunLayout(run_dir).checkpoints}" in output
    steps = [m["step"] for m in restarted.metrics() if "train/loss" in m]
    assert steps == list(range(1, MAX_STEPS + 1))
    assert resolve_checkpoint(run_dir).name == step_tag(MAX_STEPS)
    assert restarted.losses() == undisturbed.losses()
    assert restarted.validations() == undisturbed.validations()
    # --storage holds Ray Train's copies of the checkpoints.
    mirrored = {path.parent.parent.name for path in storage.glob(f"*/{step_tag(MAX_STEPS)}/unmask_state.json")}
    assert mirrored == {run_dir.name}


def test_a_newer_checkpoint_in_storage_is_restored_into_an_empty_run_dir(tinyshakespeare_shards, tmp_path):
    from ray.train import Checkpoint

    from orchestration.cluster.ray_train import restore_newer_checkpoint

    source = tmp_path / "source"
    run = run_unmask(["train", "--config", str(_config(tmp_path)), "--data", str(tinyshakespeare_shards),
                      "--run-dir", str(source), "--train.max_steps", "4"], timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-4000:]
    saved = resolve_checkpoint(source)
    fresh = tmp_path / "fresh"
    assert restore_newer_checkpoint(Checkpoint.from_directory(str(saved)), fresh)
    restored = resolve_checkpoint(fresh)
    assert restored.name == saved.name
    assert sorted(p.name for p in restored.iterdir()) == sorted(p.name for p in saved.iterdir())
    # Not newer than what the run has: left alone.
    assert not restore_newer_checkpoint(Checkpoint.from_directory(str(saved)), fresh)
    assert not (RunLayout(fresh).checkpoints / f"{saved.name}.partial").exists()
