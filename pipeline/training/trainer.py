"""The training loop: ``train(config, data_dir=..., run_dir=...)``.

It runs in every process of the job, whatever started it (``unmask train`` alone,
``deepspeed``, ``torchrun``, Ray Train): rank and world size come from the environment
(``pipeline.distributed``). Rank 0 logs and records; every rank takes part in the collectives
and writes its part of each checkpoint. What a caller relies on: stopping is always safe (a
checkpoint every ``checkpoint.every`` steps, at the end, on SIGTERM and SIGINT, and before a
failure around the steps while the weights are sound), and ``resume="auto"`` continues from
the newest intact checkpoint with the same losses, bit for bit on CPU, as a run that never
stopped. The parts come from ``build``, the run directory's life from ``pipeline.run_dir``,
the records from ``pipeline.tracking.run_records``. The manual: docs/training.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from common.errors import UserError
from common.progress import bar as progress_bar
from common.progress import bars_and_logs
from common.stop_request import StopRequested
from common.units import GIB, NATS_PER_BIT
from data_prep.shards.loader import StreamingLoader
from data_prep.shards.storage import is_remote
from pipeline.config import Config
from pipeline.distributed import init_distributed
from pipeline.run_dir.checkpoint import CheckpointManager, TrainState, read_state
from pipeline.run_dir.claim import claimed_run_dir, write_run_files
from pipeline.run_dir.resume import NOTHING_KEPT, check_resumable, checkpoint_to_resume
from pipeline.tracking.run_records import RunRecords
from pipeline.training.attention import attention_kernel
from pipeline.training.build import TrainingParts, build_parts
from pipeline.training.distillation import distillation_of
from pipeline.training.hooks import TrainHooks
from pipeline.training.init_from import InitFrom, InitRecord, init_inputs, starting_point
from pipeline.training.mask_rate_search import interval_variances, least_variance
from pipeline.training.objective import MicroBatchSlot
from pipeline.training.signals import StopSignals
from pipeline.training.throughput import IntervalMeter, mfu
from pipeline.training.validation import ValidationResult, evaluating, first_batches, validate

__all__ = ["TrainResult", "train"]

log = logging.getLogger("unmask.train")


@dataclass(frozen=True)
class TrainResult:
    """Where a call to :func:`train` left the run."""

    run_dir: Path
    step: int
    tokens_seen: int
    checkpoint: Path
    validation: ValidationResult | None
    preempted: bool
    mlflow_run_id: str | None
    init_from: InitRecord | None = None

    def summary(self) -> dict:
        """The JSON-able summary that ``unmask train`` prints and Ray Train reports."""
        summary = {"run_dir": str(self.run_dir), "step": self.step, "tokens_seen": self.tokens_seen,
                   "checkpoint": str(self.checkpoint), "preempted": self.preempted,
                   "mlflow_run_id": self.mlflow_run_id}
        if self.init_from is not None:
            summary["init_from"] = self.init_from.to_json()
        if self.validation is not None:
            summary.update(val_nelbo_per_token=self.validation.nelbo_per_token,
                           val_bits_per_byte=self.validation.bits_per_byte)
        return summary


def train(config: Config, *, data_dir: str | Path, run_dir: str | Path, resume: str = "auto",
          allow_config_change: bool = False, hooks: TrainHooks = TrainHooks(),
          init_from: InitFrom | None = None) -> TrainResult:
    """Train (or continue training) the run in ``run_dir`` on the shards in ``data_dir``.

    ``resume``: "auto" continues from the newest intact checkpoint, "never" refuses a run
    directory with checkpoints. ``init_from`` starts a new run from another run's weights
    (``pipeline.training.init_from``). ``hooks`` run on every rank (``TrainHooks``). Rank 0
    first claims and locks ``run_dir`` (``pipeline.run_dir.claim``). A process group this call
    created is left at the end, by all ranks together; a launcher's stays.
    """
    if resume not in ("auto", "never"):
        raise UserError(f"--resume must be 'auto' or 'never', got {resume!r}")
    joined_here = not torch.distributed.is_initialized()
    dist = init_distributed()
    run_dir, data_dir = Path(run_dir), data_dir if is_remote(data_dir) else Path(data_dir)
    try:
        with claimed_run_dir(run_dir, dist, data_dir, init_inputs(init_from)):
            trainer = Trainer(build_parts(config, data_dir, dist, starting_point(run_dir, init_from, dist.is_main)),
                              run_dir, hooks)
            trainer.start(resume, allow_config_change)
            result = trainer.run()
    finally:  # a lone process's RANK, MASTER_PORT, ...: nothing it starts later may rendezvous on that port
        dist.unset_variables()
    if joined_here:  # the group this call made; a launcher's (Ray Train's) is the launcher's to end
        dist.shutdown()
    return result


class Trainer:
    """One run's loop over its parts (``build.TrainingParts``)."""

    def __init__(self, parts: TrainingParts, run_dir: Path, hooks: TrainHooks) -> None:
        self.parts, self.config, self.dist, self.run_dir, self.hooks = parts, parts.config, parts.dist, run_dir, hooks
        self.checkpoints = CheckpointManager(run_dir, self.dist, self.config.checkpoint.keep_last,
                                             asynchronous=self.config.checkpoint.asynchronous,
                                             on_committed=self._committed, on_file_written=hooks.on_checkpoint_file)
        self.records = RunRecords(run_dir, self.dist.is_main)
        self.state = TrainState(loader=parts.train_loader.state_dict())
        self.objective = (distillation_of(parts, run_dir) if self.config.distill.enabled  # unmask distill
                          else parts.objective(self.config.train.block_mask_rate))

    def start(self, resume: str, allow_config_change: bool) -> None:
        """Continue the run's newest intact checkpoint, if any (``pipeline.run_dir.resume``), then
        write the run's files and start its records from that point."""
        parts, changes, resume_point = self.parts, [], NOTHING_KEPT
        directory = checkpoint_to_resume(self.checkpoints, resume)
        if directory is not None:
            saved = read_state(directory)
            changes = check_resumable(saved, parts.meta(self.state), directory, data_dir=parts.data_dir,
                                      allow_config_change=allow_config_change)
            self.checkpoints.load(parts.engine, parts.ema, directory)
            self.state = replace(saved.state)
            if self.state.block_mask_rate is not None:  # the interval the last search chose
                self.objective = parts.objective(tuple(self.state.block_mask_rate))
            # A position in global batches: the same on every rank, and on any number of ranks.
            parts.train_loader.load_state_dict(self.state.loader)
            resume_point = self.state.step
        self.records.forget_after(resume_point)  # a resumed run logs the steps after it again
        if directory is not None and self.dist.is_main:
            log.info("resumed from %s (step %d, %d tokens seen)", directory, self.state.step, self.state.tokens_seen)
        write_run_files(self.run_dir, self.config.to_dict(), parts.tokenizer, self.dist)
        self.records.start_tracking(self.config.logging, parts.identity(changes, self.state.step), resume_point)

    def run(self) -> TrainResult:
        """Train to ``train.max_steps``, or until a stop signal (then checkpoint and return)."""
        try:
            try:
                validation, preempted = self._loop()
            except StopRequested as stop:  # a signal ended a wait for data (common.stop_request)
                validation, preempted = None, self._checkpoint_after_stop(stop)
            self.checkpoints.finish()  # an asynchronous save in flight: committed before the run ends
        except BaseException:
            self.checkpoints.settle_after_failure()
            self.records.close("FAILED")
            raise
        self.records.close("KILLED" if preempted else "FINISHED")
        if preempted and self.dist.is_main:
            log.warning("stopped by a signal: checkpoint written at step %d; resume with --resume auto",
                        self.state.step)
        return TrainResult(self.run_dir, self.state.step, self.state.tokens_seen, self.checkpoints.latest(),
                           validation, preempted, self.records.run_id, self.parts.init_from)

    def _checkpoint_after_stop(self, stop: StopRequested) -> bool:
        """A signal ended a wait for data: before a step (the loader reads whole global batches,
        so the step's first micro-batch waits and nothing of the step is done) or in the
        validation after one. The state is the last whole step's: checkpointed, unless it is."""
        self.checkpoints.finish()
        step, latest = self.state.step, self.checkpoints.latest()
        if self.dist.is_main:
            log.warning("%s; the last whole step is %d", stop, step)
        if step > 0 and (latest is None or latest.name != self.checkpoints.layout.checkpoint(step).name):
            self._save()
        return True

    def _loop(self) -> tuple[ValidationResult | None, bool]:
        config, dist, state = self.config, self.dist, self.state
        signals, batches, meter = StopSignals(), _endless(self.parts.train_loader), IntervalMeter(dist.device)
        bar = progress_bar(total=config.train.max_steps, initial=state.step, unit="step", desc="train",
                           disable=not (dist.is_main and config.logging.progress))
        validation, preempted = None, False
        if dist.is_main:
            log.info("%s", self.parts.setup_line())
        try:
            # The attention kernel for the whole run: steps, validation, and the graphs compiled in them.
            with bars_and_logs(), attention_kernel(self.parts.plan.attention):  # log lines go above the bar
                if state.step == 0 and config.eval.every:
                    validation = self._validate()  # the curve starts at the initial weights
                while state.step < config.train.max_steps:
                    self._step(batches, meter)  # a failure inside a step leaves no sound state to save
                    self.checkpoints.poll()  # an asynchronous save in flight: committed once written
                    bar.update(1)
                    last = state.step == config.train.max_steps
                    validation = self._between_steps(last, meter, bar, signals) or validation
                    failed = dist.any(self.records.failure is not None)
                    preempted = dist.any(signals.requested) or failed
                    if state.step % config.checkpoint.every == 0 or last or preempted:
                        self._save()
                    if failed:
                        raise self.records.failure or UserError("rank 0 failed; its message says why")
                    if preempted:
                        break
        finally:
            bar.close()
            signals.restore()
        return validation, preempted

    def _step(self, batches: Iterator[torch.Tensor], meter: IntervalMeter) -> None:
        """One optimizer step: the global batch in micro-batches, then the EMA and the counters."""
        plan, state, engine = self.parts.plan.batches, self.state, self.parts.engine
        for micro in range(plan.accumulation):
            x0 = next(batches).to(self.dist.device, non_blocking=True)
            slot = MicroBatchSlot(seed=self.config.train.seed, step=state.step, rank=self.dist.rank,
                                  world_size=self.dist.world_size, micro=micro, micro_batches=plan.accumulation)
            if self.hooks.on_batch is not None:
                self.hooks.on_batch(state.step + 1, slot.offset(x0.shape[0]), x0)
            loss_sum = self.objective.loss_sum(self.parts.model, x0, slot)
            engine.backward(loss_sum / x0.numel())  # DeepSpeed averages over the accumulation
            engine.step()
            meter.add(loss_sum.detach(), x0.numel())
        meter.steps += 1
        state.step += 1
        state.tokens_seen += plan.global_batch * self.parts.manifest.seq_len
        if engine.was_step_applied():
            self.parts.ema.update()
            state.consecutive_skipped = 0
        else:
            self._skipped_step()

    def _skipped_step(self) -> None:
        state = self.state
        state.skipped_steps += 1
        state.consecutive_skipped += 1
        if self.dist.is_main:
            log.warning("step %d: non-finite gradients, update skipped (%d in a row)", state.step,
                        state.consecutive_skipped)
        if state.consecutive_skipped >= self.config.train.max_skipped_steps:
            latest = self.checkpoints.latest()
            raise UserError(f"training diverged: {state.consecutive_skipped} consecutive steps up to step "
                            f"{state.step} had non-finite loss or gradients (train.max_skipped_steps = "
                            f"{self.config.train.max_skipped_steps}). Lower optim.lr or raise optim.warmup_steps; "
                            f"the last good checkpoint is {latest or 'none (none written yet)'}")

    def _between_steps(self, last: bool, meter: IntervalMeter, bar: tqdm,
                       signals: StopSignals) -> ValidationResult | None:
        """Logging and validation after a completed step. Alone in the job, a failure here
        first checkpoints the (sound) state of the completed step; with other ranks it cannot
        (they wait in a collective this rank will not reach), and the failure ends the job."""
        config, step, validation = self.config, self.state.step, None
        try:
            if step % config.logging.every == 0 or last:
                self._log_interval(meter, bar)
            if (config.eval.every and step % config.eval.every == 0) or last:
                validation = self._validate()
            if self.hooks.on_step is not None:
                self.hooks.on_step(step, lambda: signals.requested)
        except Exception:
            if self.dist.world_size == 1 and self.state.consecutive_skipped == 0:
                log.error("step %d: failed after the step; writing a checkpoint first", step)
                self._save()
            raise
        return validation

    def _log_interval(self, meter: IntervalMeter, bar: tqdm) -> None:
        interval, state, engine, dist = meter.collect(self.dist), self.state, self.parts.engine, self.dist
        grad_norm = engine.get_global_grad_norm()
        metrics = {"train/loss": interval.loss, "train/bits_per_token": interval.loss / NATS_PER_BIT,
                   "train/lr": engine.get_lr()[0], "train/grad_norm": float("nan") if grad_norm is None else
                   float(grad_norm), "train/tokens_per_second": interval.tokens_per_second,
                   "train/step_time": interval.step_time, "train/tokens_seen": float(state.tokens_seen),
                   "train/skipped_steps": float(state.skipped_steps)}
        utilization = mfu(interval.tokens_per_second, self.parts.flops_per_token, self.parts.peak_flops,
                          dist.world_size)
        if utilization is not None:
            metrics["train/mfu"] = utilization
        if self.parts.anneal_steps:  # an adapted run: the share of the keys ahead of the query the next step sees
            metrics["train/attention_opened"] = min(1.0, state.step / self.parts.anneal_steps)
        if dist.device.type == "cuda":  # the allocator's own count: no device sync
            metrics["train/peak_memory_gib"] = torch.cuda.max_memory_allocated(dist.device) / GIB
        metrics.update(self.objective.state_metrics(engine.module))  # a learned schedule's exponents
        self.records.log(metrics, state.step)
        if dist.is_main:
            bar.set_postfix(loss=f"{interval.loss:.4f}", tok_s=f"{interval.tokens_per_second:,.0f}")
            log.info("step %d/%d loss %.4f nats/token (%.3f bits) lr %.2e grad %.3f %.0f tokens/s %.3f s/step%s%s",
                     state.step, self.config.train.max_steps, interval.loss, interval.loss / NATS_PER_BIT,
                     metrics["train/lr"], metrics["train/grad_norm"], interval.tokens_per_second, interval.step_time,
                     f" MFU {utilization:.1%}" if utilization is not None else "",
                     f" peak memory {metrics['train/peak_memory_gib']:.1f} GiB" if "train/peak_memory_gib" in metrics
                     else "")

    def _validate(self) -> ValidationResult:
        """The full bound on the val split with the EMA weights (and block diffusion's interval search)."""
        config, parts = self.config, self.parts
        split = parts.manifest.splits[config.data.val_split]
        with evaluating(parts.engine, parts.ema):
            result = validate(parts.model, parts.bound, parts.val_loader, config.eval.batches, config.eval.seed,
                              self.dist, bytes_per_token=split.utf8_bytes / split.tokens)
        self.records.log(result.metrics(), self.state.step)
        if self.dist.is_main:
            log.info("step %d validation (EMA weights): %.4f nats/token, perplexity <= %.2f, %.4f bits/byte",
                     self.state.step, result.nelbo_per_token, result.perplexity_bound, result.bits_per_byte)
        if config.train.block_mask_rate_search:
            self._search_mask_rate()
        return result

    def _search_mask_rate(self) -> None:
        """Train on the masking-rate interval of least clipped-loss variance on the validation
        batches (``mask_rate_search``), logged and kept in the checkpoint."""
        parts, dist, eval_ = self.parts, self.dist, self.config.eval
        batches = first_batches(parts.val_loader, eval_.batches, dist.device)
        with evaluating(parts.engine, parts.ema):
            records = interval_variances(parts.bound, parts.model, batches, eval_.seed, dist.rank, dist.world_size,
                                         dist.sum)
        best = least_variance(records)
        self.objective = parts.objective(best.interval)
        self.state.block_mask_rate = list(best.interval)
        self.records.log({"val/block_mask_rate_beta": best.interval[0], "val/block_mask_rate_omega": best.interval[1],
                          "val/block_mask_rate_loss_variance": best.variance}, self.state.step)
        if dist.is_main:
            log.info("step %d: training on masking rates in [%g, %g] (clipped-loss variance %.4g, least of %d)",
                     self.state.step, *best.interval, best.variance, len(records))

    def _save(self) -> None:
        self.state.loader = self.parts.train_loader.state_dict()
        started = time.perf_counter()
        self.checkpoints.save(self.parts.engine, self.parts.ema, self.parts.meta(self.state))
        # How long the loop waited: the whole write, or (asynchronous) the snapshot and any wait for the last one.
        self.records.log({"checkpoint/stall_s": time.perf_counter() - started}, self.state.step)

    def _committed(self, directory: Path, step: int) -> None:
        """A checkpoint is complete on disk (every rank; after its write, when asynchronous)."""
        if self.dist.is_main:
            log.info("checkpoint %s", directory)
        if self.hooks.on_checkpoint is not None:
            self.hooks.on_checkpoint(directory, step)


def _endless(loader: StreamingLoader) -> Iterator[torch.Tensor]:
    while True:
        yield from loader
