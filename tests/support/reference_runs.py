"""The reference runs of the training tests, and what a test compares with them.

Uninterrupted 6-step runs of ``MICRO_CONFIG`` (checkpoints at steps 3 and 6) at world sizes 1
and 2 under each ZeRO stage: ``tests/pipeline/conftest.py`` trains them once per session (the
``reference_runs`` fixture); tests of the trainer, resume, resharding, export and tracking
copy them, resume them, or hold their own runs against them."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from data_prep.shards.loader import StreamingLoader
from pipeline.interchange.export import export, load_export
from tests.support.batch_log import sequence_digest
from tests.support.train_helpers import MICRO_CONFIG, Run, run_train, write_config

FIRST_CHECKPOINT = "step-00000003"  # of the 6-step runs (checkpoint.every = 3)


def train_reference_runs(root: Path, shards: Path) -> dict[tuple[int, int], Run]:
    """Uninterrupted 6-step runs under ``root``, keyed by (world size, ZeRO stage)."""
    runs = {}
    for world, stage in [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]:
        config = write_config(root / f"w{world}z{stage}.yaml", {"train": {"zero_stage": stage}})
        runs[world, stage] = run_train(root / f"w{world}z{stage}", shards, config, world_size=world)
    return runs


def load_export_of(run_dir):
    return load_export(export(run_dir, out_dir=run_dir / "export-test")).network.state_dict()


def stopped_after_first_checkpoint(finished, run_dir):
    """A copy of a finished 6-step run as a job preempted after its checkpoint at step 3
    left it (with an MLflow run of its own)."""
    shutil.copytree(finished, run_dir)
    (run_dir / "checkpoints" / "latest").write_text(FIRST_CHECKPOINT)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")
    (run_dir / "mlflow_run.json").unlink()


def stream_global_batches(shards, steps):
    """Step -> digests of its global batch as the stream defines it, whatever the ranks:
    the sequences [(step - 1) G, step G) of epoch 0."""
    global_batch = MICRO_CONFIG["train"]["global_batch_size"]
    loader = StreamingLoader(shards, "train", global_batch, seed=0)  # train.seed's default
    return {step: [sequence_digest(row) for row in batch] for step, batch in zip(range(1, steps + 1), loader)}


def relative_gap(ours: dict, theirs: dict) -> float:
    flat = lambda state: torch.cat([state[name].flatten() for name in sorted(theirs)])
    return float((flat(ours) - flat(theirs)).norm() / flat(theirs).norm())
