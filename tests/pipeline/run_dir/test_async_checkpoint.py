"""Asynchronous checkpoints (``checkpoint.asynchronous``, ``pipeline.run_dir.async_checkpoint``):
the steps go on while a checkpoint is written, the files and losses are the synchronous run's, a
kill in the middle of a write leaves ``latest`` on an intact checkpoint and the resume is exact,
and a failed write stops the run in one line. Real DeepSpeed engines on CPU, real processes."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import pytest

from common.disk_full import DiskFull
from common.errors import UserError
from pipeline.config import load_config
from pipeline.distributed import Distributed
from pipeline.run_dir.async_checkpoint import AsyncSaves
from pipeline.run_dir.checkpoint import STATE_FILE, CheckpointManager, latest_checkpoint, verify_checkpoint
from pipeline.training.hooks import TrainHooks
from pipeline.training.trainer import train
from tests.support.cli_runner import DISTRIBUTED_ENV
from tests.support.reference_runs import load_export_of
from tests.support.stall import IN_WRITE_ENV
from tests.support.train_helpers import run_train, run_until_stall, write_config

ASYNC = {"checkpoint": {"every": 2, "keep_last": 2, "asynchronous": True}}
# Longer than any honest wait here: a hook that waits this long was never released.
RELEASE_TIMEOUT_S = 120


def _tags(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))


@pytest.mark.slow
@pytest.mark.parametrize("world,stage", [(1, 1), (2, 3)])
def test_asynchronous_checkpoints_keep_the_losses_weights_and_pruning(reference_runs, shards, tmp_path, world, stage):
    config = write_config(tmp_path / "c.yaml", {**ASYNC, "train": {"zero_stage": stage}})
    run = run_train(tmp_path / "run", shards, config, world_size=world)
    reference = reference_runs[world, stage]
    assert run.losses() == reference.losses()  # equal floats: checkpointing changes no step
    assert (run.run_dir / "checkpoints" / "latest").read_text() == "step-00000006"
    assert _tags(run.run_dir) == ["step-00000004", "step-00000006"]  # keep_last 2 of 2, 4, 6
    for tag in _tags(run.run_dir):
        assert verify_checkpoint(run.run_dir / "checkpoints" / tag) is None
    ours, theirs = load_export_of(run.run_dir), load_export_of(reference.run_dir)
    assert ours.keys() == theirs.keys()
    assert all(ours[name].equal(theirs[name]) for name in theirs)


@pytest.mark.slow
def test_a_kill_in_the_middle_of_a_write_leaves_latest_intact_and_the_resume_exact(reference_runs, shards, tmp_path):
    config = write_config(tmp_path / "c.yaml", ASYNC)
    run_dir = tmp_path / "run"
    killed = run_until_stall(run_dir, shards, config, stall_after=4, env={IN_WRITE_ENV: "1"})
    assert killed.returncode != 0
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000002"
    partial = run_dir / "checkpoints" / "step-00000004"
    assert any(partial.iterdir()) and not (partial / STATE_FILE).exists()  # killed after its first file
    assert latest_checkpoint(run_dir).name == "step-00000002"
    assert verify_checkpoint(run_dir / "checkpoints" / "step-00000002") is None

    resumed = run_train(run_dir, shards, config)
    assert "resumed from" in resumed.output and "step-00000002" in resumed.output
    assert resumed.losses() == reference_runs[1, 1].losses()  # equal floats, not close
    assert load_export_of(run_dir).keys() == load_export_of(reference_runs[1, 1].run_dir).keys()
    ours, theirs = load_export_of(run_dir), load_export_of(reference_runs[1, 1].run_dir)
    assert all(ours[name].equal(theirs[name]) for name in theirs)


def _in_process(config, shards: Path, run_dir: Path, hooks: TrainHooks):
    saved = {name: os.environ.get(name) for name in DISTRIBUTED_ENV}
    try:
        return train(config, data_dir=shards, run_dir=run_dir, hooks=hooks)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.mark.slow
def test_the_steps_go_on_while_a_checkpoint_is_written(shards, tmp_path):
    """The writer of checkpoint 2 is held until step 3 has run: a save that made the step wait for
    its write would never reach step 3 (the hook times out and the test fails)."""
    config = load_config(write_config(tmp_path / "c.yaml", {**ASYNC, "train": {"max_steps": 4},
                                                             "eval": {"every": 0}, "logging": {"mlflow": False}}))
    run_dir, step_3_ran, seen = tmp_path / "run", threading.Event(), {}

    def hold_the_writer(path: Path, step: int) -> None:
        if step == 2 and not step_3_ran.wait(RELEASE_TIMEOUT_S):
            seen["timed_out"] = True

    def at_step(step: int, stop_requested) -> None:
        if step == 3:
            seen["latest_at_step_3"] = latest_checkpoint(run_dir, warn=False)
            seen["state_file_at_step_3"] = (run_dir / "checkpoints" / "step-00000002" / STATE_FILE).exists()
            step_3_ran.set()

    committed = []
    result = _in_process(config, shards, run_dir, TrainHooks(on_step=at_step, on_checkpoint_file=hold_the_writer,
                                                             on_checkpoint=lambda d, s: committed.append(s)))
    assert "timed_out" not in seen
    assert seen["latest_at_step_3"] is None and seen["state_file_at_step_3"] is False  # still being written
    assert committed == [2, 4] and result.checkpoint.name == "step-00000004"
    assert verify_checkpoint(result.checkpoint) is None
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    waited = {r["step"]: r["checkpoint/stall_s"] for r in records if "checkpoint/stall_s" in r}
    assert sorted(waited) == [2, 4] and all(seconds > 0 for seconds in waited.values())


def _world_of_one() -> Distributed:
    import torch

    return Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def test_a_failed_background_write_is_raised_in_the_loop_in_one_line_and_leaves_nothing(tmp_path):
    manager = CheckpointManager(tmp_path / "run", _world_of_one(), keep_last=2, asynchronous=True)
    directory = manager.layout.checkpoint(2)
    directory.mkdir(parents=True)
    (directory / "mp_rank_00_model_states.pt").write_bytes(b"partial")

    def write() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    manager.saves.start(directory, 2, write, lambda: pytest.fail("a failed write is never committed"))
    with pytest.raises(DiskFull, match=r"No space left on device while writing .*step-00000002.*--resume auto"):
        manager.finish()
    assert not directory.exists() and manager.saves.in_flight is None
    manager.finish()  # nothing in flight any more


def test_a_save_in_flight_is_committed_once_and_only_after_its_write(tmp_path):
    order = []
    saves = AsyncSaves(_world_of_one(), lambda err, d: UserError(str(err)), lambda d, s: order.append(("committed", s)))
    released = threading.Event()
    saves.start(tmp_path, 7, lambda: (released.wait(RELEASE_TIMEOUT_S), order.append("written")),
                lambda: order.append("commit"))
    saves.poll()
    assert order == []  # still writing: a poll does not wait
    released.set()
    saves.finish()
    assert order == ["written", "commit", ("committed", 7)]

