"""``unmask train --launcher ray``: the training loop in Ray Train workers, restarted on failure.

Each of the N workers of a Ray Train ``TorchTrainer`` runs ``pipeline.training.trainer.train``, the
same loop ``torchrun`` and ``deepspeed`` start: Ray Train sets RANK, WORLD_SIZE and
MASTER_ADDR and creates the process group (gloo on CPU, NCCL on GPU), and DeepSpeed joins it.

Fault tolerance: when a worker dies, Ray Train stops the group and starts a new one, up to
``max_failures`` times. The new group resumes from the run's latest checkpoint exactly as
``--resume auto`` does, so the finished run has the losses of one that never failed.
The run directory must be visible to every worker (one machine, or a shared filesystem:
DeepSpeed's ranks write their partitions next to each other). With ``storage`` (a local
path or any pyarrow filesystem URI, e.g. ``s3://bucket/runs``) every checkpoint is also
copied there by Ray Train, and a group that finds a newer checkpoint there than in the run
directory (a lost disk, new nodes) restores it before resuming.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from common.errors import UserError
from common.logs import configure_logging
from common.ray_runtime import ray_session
from data_prep.shards.storage import resolve_location
from pipeline.config import Config
from pipeline.run_dir.checkpoint import latest_step, set_latest
from pipeline.run_dir.layout import TAG_PATTERN, RunLayout
from pipeline.run_dir.lock import JOB_ID_ENV
from pipeline.training.hooks import StepHook, TrainHooks
from pipeline.training.init_from import InitFrom
from pipeline.training.trainer import train

__all__ = ["RayLaunch", "launch", "restore_newer_checkpoint"]

log = logging.getLogger("unmask.ray_train")



@dataclass(frozen=True)
class RayLaunch:
    """How many Ray Train workers, with what resources, restarted how often, on which cluster."""

    num_workers: int
    gpus_per_worker: float = 0.0      # 0: CPU workers (gloo)
    cpus_per_worker: float = 1.0
    max_failures: int = 0             # worker-group restarts before the run fails
    address: str | None = None        # None: the job's cluster, else a local Ray
    storage: str | None = None        # durable checkpoint copies: a path or a pyarrow URI

    def check(self) -> None:
        checks = [("--num-workers", self.num_workers >= 1, "must be >= 1"),
                  ("--gpus-per-worker", self.gpus_per_worker >= 0, "must be >= 0"),
                  ("--cpus-per-worker", self.cpus_per_worker > 0, "must be > 0"),
                  ("--max-failures", self.max_failures >= -1, "must be >= 0 (or -1: retry forever)")]
        for flag, ok, requirement in checks:
            if not ok:
                raise UserError(f"{flag} {requirement}")


def _storage_path(launch: RayLaunch, run_dir: Path) -> str:
    if launch.storage is None:
        return str(RunLayout(run_dir).ray_train)
    return launch.storage if "://" in launch.storage else str(Path(launch.storage).resolve())


def _local_step(run_dir: Path) -> int:
    step = latest_step(run_dir)
    return -1 if step is None else step


def restore_newer_checkpoint(checkpoint: Any, run_dir: Path) -> bool:
    """Copy a Ray Train ``checkpoint`` (one of ours, named ``step-NNNNNNNN``) into the run
    directory and make it ``latest`` when it is newer than the run's own latest one."""
    if checkpoint is None:
        return False
    tag = Path(checkpoint.path).name
    match = TAG_PATTERN.match(tag)
    if match is None or int(match.group(1)) <= _local_step(run_dir):
        return False
    target = RunLayout(run_dir).checkpoints / tag
    partial = target.with_name(tag + ".partial")
    checkpoint.to_directory(str(partial))
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)
    set_latest(run_dir, tag)
    log.info("restored %s from %s", tag, checkpoint.path)
    return True


def _mirror_checkpoint(directory: Path, step: int) -> None:
    """Every rank reports (Ray Train's report is a barrier); rank 0 hands over the files."""
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    checkpoint = ray.train.Checkpoint.from_directory(str(directory)) if rank == 0 else None
    ray.train.report({"step": step}, checkpoint=checkpoint, checkpoint_dir_name=directory.name,
                     delete_local_checkpoint_after_upload=False)


def _worker_loop(payload: dict) -> None:
    """What each Ray Train worker runs, on the first start and after every restart."""
    import ray.train
    import torch.distributed

    configure_logging()
    # A restarted group is the same job: its rank 0 waits for the old one's run-dir lock.
    os.environ[JOB_ID_ENV] = payload["job_id"]
    run_dir, mirror = Path(payload["run_dir"]), payload["mirror"]
    if mirror and ray.train.get_context().get_world_rank() == 0:
        restore_newer_checkpoint(ray.train.get_checkpoint(), run_dir)
    torch.distributed.barrier()  # every rank resumes from the same latest
    hooks = TrainHooks(on_step=payload["on_step"], on_checkpoint=_mirror_checkpoint if mirror else None)
    # A restarted group finds the first group's checkpoints and resumes them (init_from is not reloaded).
    result = train(payload["config"], data_dir=payload["data_dir"], run_dir=run_dir, resume="auto",
                   allow_config_change=payload["allow_config_change"], hooks=hooks, init_from=payload["init_from"])
    ray.train.report(result.summary())


def _local_cpus(launch: RayLaunch) -> int:
    # For a local Ray only. Its CPUs are a scheduling count: a local run may ask for more
    # workers than the machine has cores.
    return max(os.cpu_count() or 1, math.ceil(launch.num_workers * launch.cpus_per_worker))


def launch(config: Config, ray_launch: RayLaunch, *, data_dir: str | Path, run_dir: str | Path,
           resume: str = "auto", allow_config_change: bool = False, on_step: StepHook | None = None,
           init_from: InitFrom | None = None) -> dict:
    """Train ``config`` with ``ray_launch.num_workers`` Ray Train workers; the run's summary.
    ``on_step`` (picklable: it travels to the workers) runs on every rank after each step;
    ``init_from`` starts a new run from another's weights (``pipeline.training.trainer.train``)."""
    ray_launch.check()
    run_dir = Path(run_dir).resolve()
    if resume == "never" and _local_step(run_dir) >= 0:
        raise UserError(f"{run_dir} already has checkpoints; pass --resume auto to continue it "
                        f"or choose a new --run-dir")
    if init_from is not None:  # the workers' working directory is not ours
        init_from = replace(init_from, path=str(Path(init_from.path).resolve()))
    # A URI unchanged (each worker reads the store), a local path absolute (the workers'
    # working directory is not the driver's).
    payload = {"config": config, "data_dir": resolve_location(data_dir), "run_dir": str(run_dir),
               "allow_config_change": allow_config_change, "mirror": ray_launch.storage is not None,
               "job_id": f"ray-train-{uuid.uuid4().hex}", "on_step": on_step, "init_from": init_from}
    with ray_session(ray_launch.address, num_cpus=_local_cpus(ray_launch), log_to_driver=True):
        result = _trainer(config, ray_launch, run_dir, payload).fit()
    if result.error is not None:
        raise UserError(f"Ray Train run {run_dir} failed after {ray_launch.max_failures} restart(s) "
                        f"(--max-failures): {result.error}")
    return {**(result.metrics or {}), "run_dir": str(run_dir), "launch": asdict(ray_launch)}


def _trainer(config: Config, ray_launch: RayLaunch, run_dir: Path, payload: dict):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    use_gpu = ray_launch.gpus_per_worker > 0
    resources = {"CPU": ray_launch.cpus_per_worker, **({"GPU": ray_launch.gpus_per_worker} if use_gpu else {})}
    return TorchTrainer(
        _worker_loop, train_loop_config=payload,
        scaling_config=ScalingConfig(num_workers=ray_launch.num_workers, use_gpu=use_gpu,
                                     resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(name=run_dir.name, storage_path=_storage_path(ray_launch, run_dir),
                             failure_config=FailureConfig(max_failures=ray_launch.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=config.checkpoint.keep_last)))
