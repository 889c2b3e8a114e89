"""Resuming on another number of ranks (``pipeline.run_dir.reshard``): the checkpoint converted to
DeepSpeed's universal form, reused by a rerun and redone when broken; the resumed run sees the same
global batches and gives the uninterrupted run's losses up to float rounding."""

from __future__ import annotations

import logging
import shutil

import pytest

from pipeline.run_dir.checkpoint import verify_checkpoint
from pipeline.run_dir.rank_files import rank_file
from pipeline.run_dir.reshard import UNIVERSAL_DIR, universal_checkpoint
from tests.support.batch_log import logged_global_batches
from tests.support.reference_runs import (
    FIRST_CHECKPOINT,
    load_export_of,
    relative_gap,
    stopped_after_first_checkpoint,
    stream_global_batches,
)
from tests.support.train_helpers import MICRO_CONFIG, run_train, write_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("before,after,stage,weight_decay", [(2, 1, 1, None), (1, 2, 3, 0.1)])
def test_resume_on_another_number_of_ranks_sees_the_same_global_batches(tmp_path, shards, reference_runs, before,
                                                                        after, stage, weight_decay):
    """A 6-step run on BEFORE ranks, preempted after its checkpoint at step 3, resumed on AFTER
    ranks: steps 4-6 take the same sequences into the same places of the global batch, and
    give the uninterrupted run's losses and EMA up to float rounding. Step 4 starts from the
    same weights with the same batch, times and masks: equal up to the order of the float64
    sums over ranks. Later the gradients are summed in another order (one rank accumulates
    what two all-reduce), which moves the weights by float32 rounding: the losses stayed within
    1e-8 of the uninterrupted ones (relative), and a lost piece of optimizer state moves them
    by 1e-6 or more (DeepSpeed's ZeRO-3 universal loader, left alone, gives the norms the
    matrices' weight decay: 3e-6 at step 5; and runs their bias correction ahead: 2e-6 at
    step 5, 5e-4 at step 6)."""
    overrides = {"train": {"zero_stage": stage}}
    if weight_decay is None:
        reference = reference_runs[before, stage]
    else:  # weight decay on the matrices only: param groups with their own hyperparameters
        overrides["optim"] = {**MICRO_CONFIG["optim"], "weight_decay": weight_decay}
        reference = run_train(tmp_path / "reference", shards, write_config(tmp_path / "r.yaml", overrides),
                              world_size=before, log_batches=True)
    config = write_config(tmp_path / "c.yaml", overrides)
    run_dir = tmp_path / "run"
    stopped_after_first_checkpoint(reference.run_dir, run_dir)
    resumed = run_train(run_dir, shards, config, world_size=after, log_batches=True)
    assert f"{FIRST_CHECKPOINT} was written by {before} rank(s); resuming it on {after}" in resumed.output
    logged, stream = logged_global_batches(run_dir), stream_global_batches(shards, 6)
    assert {4, 5, 6} <= logged.keys() and logged == {step: stream[step] for step in logged}
    ours, theirs = resumed.losses(), reference.losses()
    assert ours.keys() == theirs.keys() == {1, 2, 3, 4, 5, 6}
    assert ours[4] == pytest.approx(theirs[4], rel=1e-12)
    for step in (5, 6):
        assert ours[step] == pytest.approx(theirs[step], rel=1e-7), step
    assert relative_gap(load_export_of(run_dir), load_export_of(reference.run_dir)) < 1e-7


def test_a_conversion_is_reused_by_a_rerun_and_redone_when_broken(tmp_path, reference_runs, caplog):
    """The universal form of a checkpoint (written by rank 0 before a resume on another number
    of ranks) is staged under a temporary name; a rerun reuses it once its files check out."""
    checkpoint = tmp_path / FIRST_CHECKPOINT
    shutil.copytree(reference_runs[2, 1].run_dir / "checkpoints" / FIRST_CHECKPOINT, checkpoint)
    rank_files = [rank_file(checkpoint, rank) for rank in range(2)]
    (checkpoint / (UNIVERSAL_DIR + ".tmp")).mkdir()  # what a killed conversion leaves
    caplog.set_level(logging.INFO, logger="unmask.checkpoint")
    universal = universal_checkpoint(checkpoint, rank_files)
    assert not (checkpoint / (UNIVERSAL_DIR + ".tmp")).exists() and "converted" in caplog.text
    written = {path: path.stat().st_mtime_ns for path in universal.rglob("*")}
    caplog.clear()
    assert universal_checkpoint(checkpoint, rank_files) == universal and "reusing" in caplog.text
    assert {path: path.stat().st_mtime_ns for path in universal.rglob("*")} == written
    altered = universal / "ema.pt"
    altered.write_bytes(altered.read_bytes()[:-8])
    caplog.clear()
    universal_checkpoint(checkpoint, rank_files)
    assert f"converting again ({altered} differs from the one converted)" in caplog.text
    assert verify_checkpoint(checkpoint) is None  # the checkpoint's own files are untouched
