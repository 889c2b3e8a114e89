"""The training loop: DeepSpeed engine, weighted ELBO, EMA, validation, checkpoints, MLflow.

``train(config, data_dir=..., run_dir=...)`` runs in every process of the job, whatever
started it (``unmask train`` alone, ``deepspeed``, ``torchrun``, Ray Train): it reads
rank and world size from the environment (``pipeline.distributed``). Rank 0 logs and
tracks; every rank takes part in the collectives and writes its part of each checkpoint.

Stopping is always safe: a checkpoint is written every ``checkpoint.every`` steps, at the
end, on SIGTERM (preemption) and SIGINT (Ctrl-C), and before a failure of what surrounds
the steps (a full disk under ``metrics.jsonl``, a failed validation) while the weights are
sound. ``resume="auto"`` continues from the newest intact checkpoint with the same losses,
bit for bit on CPU, as a run that never stopped. Rank 0 holds the run directory's lock
(``pipeline.run_dir.lock``) for the whole run, and tracks through a background queue
(``pipeline.tracking.background``): a tracking server that goes down costs no step.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import asdict, dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from common.atomic_files import atomic_write_bytes
from common.errors import UserError
from common.outputs import OutputClaim, claim_output_dir
from common.progress import bar as progress_bar
from common.progress import bars_and_logs
from common.provenance import git_commit
from common.units import GIB, NATS_PER_BIT
from data_prep.shards.format import Manifest
from data_prep.shards.loader import StreamingLoader
from data_prep.shards.storage import ChunkCache, default_cache_dir, is_remote, localize_metadata
from model.spec import ModelSpec, build_trainable
from model.transformer import Transformer, TransformerConfig
from pipeline.config import Config, ModelSection, config_differences, with_legacy_values
from pipeline.distributed import Distributed, init_distributed
from pipeline.run_dir.checkpoint import (
    CheckpointManager,
    CheckpointMeta,
    TrainState,
    latest_checkpoint,
    read_state,
    write_failure,
)
from pipeline.run_dir.layout import RUN_KIND, RunLayout, training_data
from pipeline.run_dir.lock import RunLock
from pipeline.tracking.background import FAILED_CLOSE_WAIT_S, BackgroundTracker
from pipeline.tracking.tracker import OPTIONAL_WAIT_S, REACHABLE_WAIT_S, Tracker, TrackingUnreachable, flatten_params
from pipeline.training.attention import attention_kernel
from pipeline.training.ema import EMA
from pipeline.training.engine import TrainingPlan, build_engine, deepspeed_config, plan_training
from pipeline.training.hooks import TrainHooks
from pipeline.training.init_from import (
    InitFrom,
    InitRecord,
    InitSource,
    check_tokenizer,
    init_inputs,
    load_source,
    read_source,
    recorded_source,
    with_source_architecture,
)
from pipeline.training.mask_rate_search import interval_variances, least_variance
from pipeline.training.objective import MicroBatchSlot, make_objective, model_spec
from pipeline.training.run_setup import find_tokenizer, network_config
from pipeline.training.throughput import block_diffusion_flops_per_token, flops_per_token, mfu, peak_flops
from pipeline.training.validation import ValidationResult, validate

__all__ = ["TrainResult", "train"]

log = logging.getLogger("unmask.train")
# The resume point of a run started from scratch: no step's records are kept.
NOTHING_KEPT = -1


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


class _Preemption:
    """Turns SIGTERM and SIGINT into a flag the loop checks at each step boundary; a second
    SIGINT interrupts at once (the user insists)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        # Only the main thread may install handlers; Ray Train runs the loop in a worker
        # thread and handles preemption itself.
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def restore(self) -> None:
        if self._installed:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)


def _endless(loader: StreamingLoader) -> Iterator[torch.Tensor]:
    while True:
        yield from loader


class Trainer:
    """One run's loop; built by ``train``."""

    def __init__(self, config: Config, data_dir: str | Path, run_dir: Path, dist: Distributed,
                 hooks: TrainHooks = TrainHooks(), start: InitRecord | InitSource | None = None) -> None:
        """``start``: the source a run started with --init-from begins from (an ``InitSource``,
        loaded into the new network), or the record of the one it began from (an
        ``InitRecord``: a resumed run, whose network takes the source's architecture and
        whose weights come from its own checkpoint)."""
        self.config, self.data_dir, self.run_dir, self.dist = config, data_dir, run_dir, dist
        self.layout = RunLayout(run_dir)
        self.hooks = hooks
        # From object storage, the manifest and the tokenizer are read from a local copy.
        metadata = localize_metadata(str(data_dir), self._cache_root()) if is_remote(data_dir) else Path(data_dir)
        self.manifest = Manifest.read(metadata)
        self.tokenizer = find_tokenizer(self.manifest, metadata)
        self.init_from = start.record if isinstance(start, InitSource) else start
        self.network_config = network_config(config.model, self.manifest)
        if self.init_from is not None:
            self.network_config = with_source_architecture(self.network_config, self.init_from)
        if isinstance(start, InitSource):
            check_tokenizer(start.record, self.tokenizer.sha256, data_dir)
        self.plan: TrainingPlan = plan_training(config, self.network_config, dist.world_size, dist.device)
        self.train_loader, self.val_loader = self._loaders()
        spec, validate = model_spec(config.model, self.network_config), dist.device.type == "cpu"
        torch.manual_seed(config.train.seed)  # the same initial weights on every rank
        model = build_trainable(spec, validate=validate)  # the network (and a learned schedule)
        if isinstance(start, InitSource):  # before DeepSpeed partitions it: every ZeRO stage gets these values
            load_source(model, start, self.network_config)
        model = model.to(dist.device)
        if isinstance(model, Transformer):
            model.block_attention = self.plan.block_attention  # block diffusion's mask (model.block_attention)
        self.engine = build_engine(model, self.plan, config.optim, config.train.max_steps, dist.device)
        self.ema = EMA(self.engine.module, config.train.ema_decay, warmup=config.train.ema_warmup)
        self.objective = make_objective(spec, validate=validate, chunk_rows=config.train.chunked_cross_entropy,
                                        block_mask_rate=config.train.block_mask_rate)
        self.checkpoints = CheckpointManager(run_dir, dist, config.checkpoint.keep_last)
        self.state = TrainState(loader=self.train_loader.state_dict())
        self.tracker: BackgroundTracker | None = None
        # A failure of rank 0's own bookkeeping (metrics.jsonl), raised once every rank has
        # checkpointed at the next step boundary.
        self.deferred_failure: UserError | None = None
        self.config_changes: list[str] = []
        # The last step whose records (metrics.jsonl, MLflow) stand: the checkpoint resumed
        # from, or NOTHING_KEPT from scratch, where even step 0's validation is logged again.
        self.resume_point = NOTHING_KEPT
        block_size = config.model.block_size
        self.flops_per_token = (flops_per_token(self.network_config, self.manifest.seq_len) if block_size is None else
                                block_diffusion_flops_per_token(self.network_config, self.manifest.seq_len, block_size))
        self.peak = peak_flops(dist.device)

    def _cache_root(self) -> Path:
        return Path(self.config.data.cache_dir) if self.config.data.cache_dir else default_cache_dir()

    def _loaders(self) -> tuple[StreamingLoader, StreamingLoader]:
        c, d = self.config, self.dist
        cache = None
        if is_remote(self.data_dir) and c.data.cache_gb > 0:
            cache = ChunkCache(self._cache_root() / "chunks", int(c.data.cache_gb * GIB))
        common = dict(rank=d.rank, world_size=d.world_size, cache=cache)
        micro_batch = self.plan.batches.micro_batch
        train = StreamingLoader(self.data_dir, c.data.train_split, micro_batch, seed=c.train.seed,
                                global_batch_size=self.plan.batches.global_batch, num_workers=c.data.num_workers,
                                shuffle_window=c.data.shuffle_window,
                                pin_memory=d.device.type == "cuda", **common)
        val = StreamingLoader(self.data_dir, c.data.val_split, c.eval.micro_batch_size or micro_batch,
                              seed=c.eval.seed, shuffle=False, **common)
        return train, val

    # ------------------------------------------------------------------ identity
    def meta(self) -> CheckpointMeta:
        """What a checkpoint of this run records besides its tensors."""
        return CheckpointMeta(state=replace(self.state), config=self.config.to_dict(),
                              config_sha256=self.config.sha256(), data_sha256=self.manifest.sha256(),
                              tokenizer_sha256=self.tokenizer.sha256, network=asdict(self.network_config),
                              zero_stage=self.plan.zero_stage, precision=self.plan.precision,
                              batch_plan=asdict(self.plan.batches), world_size=self.dist.world_size,
                              init_from=self.init_from.to_json() if self.init_from else None)

    def resume(self, mode: str, allow_config_change: bool) -> None:
        """``mode``: "auto" (latest if any), "never" (refuse a run dir with checkpoints)."""
        latest = self.checkpoints.latest()
        if latest is None:
            self._forget_metrics_after(self.resume_point)  # of a run killed before its first checkpoint
            return
        if mode == "never":
            raise UserError(f"{self.run_dir} already has checkpoints (latest {latest.name}); pass "
                            f"--resume auto to continue it or choose a new --run-dir")
        intact = self.checkpoints.newest_intact()
        saved = self._check_compatible(intact, allow_config_change)
        self.checkpoints.load(self.engine, self.ema, intact)
        self.state = replace(saved.state)
        if self.state.block_mask_rate is not None:  # the interval the last search chose
            self.objective.mask_rate = tuple(self.state.block_mask_rate)
        # A position in global batches: the same on every rank, and on any number of ranks.
        self.train_loader.load_state_dict(self.state.loader)
        self.resume_point = self.state.step
        self._forget_metrics_after(self.resume_point)
        if self.dist.is_main:
            log.info("resumed from %s (step %d, %d tokens seen)", intact, self.state.step, self.state.tokens_seen)

    def _forget_metrics_after(self, step: int) -> None:
        """Rank 0: drop the records of steps after ``step`` (the resume point): the resumed run
        logs them again, and metrics.jsonl holds each step once."""
        path = self.layout.metrics
        if not self.dist.is_main or not path.is_file():
            return
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _record_step(line) <= step]
        if len(kept) != len(lines):
            atomic_write_bytes(path, "".join(kept).encode("utf-8"))

    def _check_compatible(self, directory: Path, allow_config_change: bool) -> CheckpointMeta:
        saved = read_state(directory)
        if saved.tokenizer_sha256 != self.tokenizer.sha256 or saved.data_sha256 != self.manifest.sha256():
            what = "tokenizer" if saved.tokenizer_sha256 != self.tokenizer.sha256 else "data (manifest.json)"
            if not allow_config_change or what == "tokenizer":
                raise UserError(f"cannot resume {directory}: its {what} differs from {self.data_dir}'s"
                                + ("" if what == "tokenizer" else "; pass --allow-config-change to "
                                   "continue on the new data anyway"))
        differ = config_differences(saved.config, self.config.to_dict())
        if differ and not allow_config_change:
            raise UserError(f"cannot resume {directory} with a different config: " + "; ".join(differ)
                            + ". Pass --allow-config-change to resume anyway.")
        mismatch = _first_tensor_mismatch(saved, model_spec(self.config.model, self.network_config))
        if mismatch is not None:
            changed = ", ".join(d.split(":")[0] for d in differ if d.startswith("model.")) or "model"
            raise UserError(f"cannot resume {directory}: the network changed shape ({changed}): {mismatch}. "
                            f"--allow-config-change cannot reshape weights: keep the checkpoint's model section, or "
                            f"train this one in a new --run-dir")
        self.config_changes = config_differences(saved.config, self.config.to_dict(), include_resume_safe=True)
        return saved

    # ------------------------------------------------------------------ tracking
    def start_tracking(self) -> None:
        if not (self.dist.is_main and self.config.logging.mlflow):
            return
        logging_ = self.config.logging
        try:
            tracker = Tracker.open(self.run_dir, tracking_uri=logging_.mlflow_uri, experiment=logging_.experiment,
                                   run_name=logging_.run_name,
                                   wait_s=REACHABLE_WAIT_S if logging_.mlflow_required else OPTIONAL_WAIT_S)
            self._log_run_identity(tracker)
            skip = tracker.logged_steps_after(self.resume_point)
        except TrackingUnreachable as err:
            if logging_.mlflow_required:
                raise
            log.warning("%s. Training without MLflow (logging.mlflow_required is false); metrics go to %s",
                        str(err).split("; ")[0], self.layout.metrics)
            return
        except UserError:
            raise
        except Exception as err:  # the server failed between its health check and our first requests
            raise TrackingUnreachable(f"MLflow at {logging_.mlflow_uri or 'the run directory'} failed at the start "
                                      f"of the run ({type(err).__name__}: {str(err)[:300]}); retry, or pass "
                                      "--logging.mlflow_required false to train without it") from None
        self.tracker = BackgroundTracker(tracker, skip=skip, metrics_file=str(self.layout.metrics))

    def _log_run_identity(self, tracker) -> None:
        """Params, tags and config artifacts, once at the start (before any step)."""
        plan = self.plan
        derived = {"world_size": self.dist.world_size, "micro_batch": plan.batches.micro_batch,
                   "accumulation": plan.batches.accumulation, "zero_stage": plan.zero_stage,
                   "precision": plan.precision, "parameters": plan.parameters,
                   "activation_checkpointing": plan.activation_checkpointing, "compile": plan.compile,
                   "attention": plan.attention,
                   "seq_len": self.manifest.seq_len, "vocab_size": self.network_config.vocab_size,
                   "network": asdict(self.network_config)}  # the shape the preset and overrides resolved to
        if self.config.model.block_size is not None:
            derived["block_attention"] = plan.block_attention
        params = flatten_params({**self.config.to_dict(), "resolved": derived, **self._init_params()})
        if self.config_changes:
            # MLflow params are immutable: keep the values the run started with and record
            # the change, with the step it took effect, as a tag.
            changed = {change.split(":")[0] for change in self.config_changes}
            params = {k: v for k, v in params.items() if k not in changed}
            tracker.set_tags({f"config_change.step_{self.state.step}": "; ".join(self.config_changes)})
        tracker.log_params(params)
        tracker.set_tags({"git_commit": git_commit(), "data_manifest_sha256": self.manifest.sha256(),
                               "tokenizer_sha256": self.tokenizer.sha256, "data_dir": str(self.data_dir)})
        if self.init_from is not None:
            tracker.set_tags({"init_from": self.init_from.source, "init_from_sha256": self.init_from.sha256})
        tracker.log_text(json.dumps(self.config.to_dict(), indent=2), self.layout.config.name)
        tracker.log_text(json.dumps(deepspeed_config(self.plan, self.config.optim), indent=2),
                         "deepspeed_config.json")

    def _init_params(self) -> dict:
        """The source of the first weights as params (``init_from.*``; its network is in ``resolved``)."""
        if self.init_from is None:
            return {}
        return {"init_from": {k: v for k, v in self.init_from.to_json().items() if k != "network"}}

    def write_run_files(self) -> None:
        """The resolved config and the tokenizer, so that the run dir stands on its own."""
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.layout.config.write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
            self.tokenizer.save(self.layout.tokenizer)
        self.dist.barrier()

    def _record(self, metrics: dict[str, float], step: int) -> None:
        """Rank 0: append to metrics.jsonl and queue for MLflow. A failed write is raised at
        the next step boundary, after every rank has checkpointed."""
        path = self.layout.metrics
        try:
            with open(path, "a", encoding="utf-8") as out:
                out.write(json.dumps({"step": step, **metrics}) + "\n")
        except OSError as err:
            self.deferred_failure = self.deferred_failure or write_failure(err, path, self.run_dir)
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step)

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainResult:
        config, dist = self.config, self.dist
        preemption = _Preemption()
        batches = _endless(self.train_loader)
        bar = progress_bar(total=config.train.max_steps, initial=self.state.step, unit="step", desc="train",
                           disable=not (dist.is_main and config.logging.progress))
        interval = _Interval(dist.device)
        validation, preempted = None, False
        if dist.is_main:
            self._log_setup()
        try:
            # The attention kernel for the whole run: steps, validation, and the graphs compiled in them.
            with bars_and_logs(), attention_kernel(self.plan.attention):  # log lines go above the bar
                if self.state.step == 0 and config.eval.every:
                    validation = self._validate()  # the curve starts at the initial weights
                while self.state.step < config.train.max_steps:
                    self._step(batches, interval)  # a failure inside a step leaves no sound state to save
                    step = self.state.step
                    bar.update(1)
                    last = step == config.train.max_steps
                    validation = self._between_steps(step, last, interval, bar, preemption) or validation
                    failed = dist.any(self.deferred_failure is not None)
                    preempted = dist.any(preemption.requested) or failed
                    if step % config.checkpoint.every == 0 or last or preempted:
                        self._save()
                    if failed:
                        raise self.deferred_failure or UserError("rank 0 failed; its message says why")
                    if preempted:
                        break
        finally:
            bar.close()
            preemption.restore()
        if self.tracker is not None:
            self.tracker.close("KILLED" if preempted else "FINISHED")
        if preempted and dist.is_main:
            log.warning("stopped by a signal: checkpoint written at step %d; resume with --resume auto",
                        self.state.step)
        return TrainResult(self.run_dir, self.state.step, self.state.tokens_seen, self.checkpoints.latest(),
                           validation, preempted, self.tracker.run_id if self.tracker else None, self.init_from)

    def _between_steps(self, step: int, last: bool, interval: "_Interval", bar: tqdm,
                       preemption: _Preemption) -> ValidationResult | None:
        """Logging and validation after a completed step. Alone in the job, a failure here
        first checkpoints the (sound) state of the completed step; with other ranks it cannot
        (they wait in a collective this rank will not reach), and the failure ends the job."""
        config, validation = self.config, None
        try:
            if step % config.logging.every == 0 or last:
                self._log_interval(interval, bar)
            if (config.eval.every and step % config.eval.every == 0) or last:
                validation = self._validate()
            if self.hooks.on_step is not None:
                self.hooks.on_step(step, lambda: preemption.requested)
        except Exception:
            if self.dist.world_size == 1 and self.state.consecutive_skipped == 0:
                log.error("step %d: failed after the step; writing a checkpoint first", step)
                self._save()
            raise
        return validation

    def _log_setup(self) -> None:
        """What the run resolved to, "auto" settings included: the line to read when it is slow."""
        plan, batches, train = self.plan, self.plan.batches, self.config.train
        chunks = f"{plan.chunked_cross_entropy} rows" if plan.chunked_cross_entropy else "off"
        auto = _marked_auto
        log.info("setup: %d rank(s), micro-batch %d%s x %d accumulation, ZeRO-%d, %s, activation checkpointing %s%s, "
                 "compile %s%s, attention %s%s, chunked cross-entropy %s, vocabulary %d padded to %d",
                 batches.world_size, batches.micro_batch, auto(train.micro_batch_size), batches.accumulation,
                 plan.zero_stage, plan.precision, "on" if plan.activation_checkpointing else "off",
                 auto(train.activation_checkpointing), "on" if plan.compile else "off", auto(train.compile),
                 plan.attention, auto(train.attention), chunks, self.network_config.vocab_size,
                 self.network_config.logit_columns)

    def _step(self, batches: Iterator[torch.Tensor], interval: "_Interval") -> None:
        """One optimizer step: the global batch in micro-batches, then EMA and bookkeeping."""
        plan, state, engine = self.plan.batches, self.state, self.engine
        for micro in range(plan.accumulation):
            x0 = next(batches).to(self.dist.device, non_blocking=True)
            slot = MicroBatchSlot(seed=self.config.train.seed, step=state.step, rank=self.dist.rank,
                                  world_size=self.dist.world_size, micro=micro, micro_batches=plan.accumulation)
            if self.hooks.on_batch is not None:
                self.hooks.on_batch(state.step + 1, slot.offset(x0.shape[0]), x0)
            loss_sum = self.objective.loss_sum(engine, x0, slot)
            engine.backward(loss_sum / x0.numel())  # DeepSpeed averages over the accumulation
            engine.step()
            interval.add(loss_sum.detach(), x0.numel())
        interval.steps += 1
        state.step += 1
        state.tokens_seen += plan.global_batch * self.manifest.seq_len
        if engine.was_step_applied():
            self.ema.update()
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

    def _log_interval(self, interval: "_Interval", bar: tqdm) -> None:
        loss_sum, tokens, seconds, steps = interval.collect(self.dist)
        loss = loss_sum / tokens
        tokens_per_second = tokens / seconds if seconds > 0 else float("nan")
        metrics = {"train/loss": loss, "train/bits_per_token": loss / NATS_PER_BIT,
                   "train/lr": self.engine.get_lr()[0], "train/grad_norm": _grad_norm(self.engine),
                   "train/tokens_per_second": tokens_per_second, "train/step_time": seconds / steps,
                   "train/tokens_seen": float(self.state.tokens_seen),
                   "train/skipped_steps": float(self.state.skipped_steps)}
        utilization = mfu(tokens_per_second, self.flops_per_token, self.peak, self.dist.world_size)
        if utilization is not None:
            metrics["train/mfu"] = utilization
        if self.dist.device.type == "cuda":  # the allocator's own count: no device sync
            metrics["train/peak_memory_gib"] = torch.cuda.max_memory_allocated(self.dist.device) / GIB
        metrics.update(self.objective.state_metrics(self.engine))  # a learned schedule's exponents
        if self.dist.is_main:
            self._record(metrics, self.state.step)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_second:,.0f}")
            log.info("step %d/%d loss %.4f nats/token (%.3f bits) lr %.2e grad %.3f %.0f tokens/s %.3f s/step%s%s",
                     self.state.step, self.config.train.max_steps, loss, loss / NATS_PER_BIT, metrics["train/lr"],
                     metrics["train/grad_norm"], tokens_per_second, seconds / steps,
                     f" MFU {utilization:.1%}" if utilization is not None else "",
                     f" peak memory {metrics['train/peak_memory_gib']:.1f} GiB" if "train/peak_memory_gib" in metrics
                     else "")

    def _validate(self) -> ValidationResult:
        split = self.manifest.splits[self.config.data.val_split]
        result = validate(self.engine, self.ema, self.objective, self.val_loader, self.config.eval.batches,
                          self.config.eval.seed, self.dist, bytes_per_token=split.utf8_bytes / split.tokens)
        if self.dist.is_main:
            self._record(result.metrics(), self.state.step)
            log.info("step %d validation (EMA weights): %.4f nats/token, perplexity <= %.2f, %.4f bits/byte",
                     self.state.step, result.nelbo_per_token, result.perplexity_bound, result.bits_per_byte)
        if self.config.train.block_mask_rate_search:
            self._search_mask_rate()
        return result

    def _search_mask_rate(self) -> None:
        """Train on the masking-rate interval of least clipped-loss variance on the validation
        batches (``pipeline.training.mask_rate_search``), logged and kept in the checkpoint."""
        loader, wanted = self.val_loader, self.config.eval.batches
        count = len(loader) if wanted is None else min(wanted, len(loader))
        loader.rewind()
        batches = [x0.to(self.dist.device) for x0 in islice(loader, count)]
        self.engine.eval()
        try:
            with self.ema.applied():
                records = interval_variances(self.objective, self.engine, batches, self.config.eval.seed,
                                             self.dist.rank, self.dist.world_size, self.dist.sum)
        finally:
            self.engine.train()
        best = least_variance(records)
        self.objective.mask_rate = best.interval
        self.state.block_mask_rate = list(best.interval)
        if self.dist.is_main:
            self._record({"val/block_mask_rate_beta": best.interval[0], "val/block_mask_rate_omega": best.interval[1],
                          "val/block_mask_rate_loss_variance": best.variance}, self.state.step)
            log.info("step %d: training on masking rates in [%g, %g] (clipped-loss variance %.4g, least of %d)",
                     self.state.step, *best.interval, best.variance, len(records))

    def _save(self) -> None:
        self.state.loader = self.train_loader.state_dict()
        directory = self.checkpoints.save(self.engine, self.ema, self.meta())
        if self.dist.is_main:
            log.info("checkpoint %s", directory)
        if self.hooks.on_checkpoint is not None:
            self.hooks.on_checkpoint(directory, self.state.step)


class _Interval:
    """Loss and token sums since the last log, kept on the device (no host sync per step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.tokens, self.steps, self.start = 0, 0, time.perf_counter()

    def add(self, loss_sum: torch.Tensor, tokens: int) -> None:
        self.loss += loss_sum
        self.tokens += tokens

    def collect(self, dist: Distributed) -> tuple[float, float, float, int]:
        """(loss sum, tokens) over all ranks, seconds and steps since the last collect."""
        loss, tokens = dist.sum([self.loss.item(), float(self.tokens)])
        seconds = time.perf_counter() - self.start
        steps = max(self.steps, 1)
        self._reset()
        return loss, tokens, seconds, steps


def _marked_auto(setting: object) -> str:
    """" (auto)" after a value that an "auto" setting decided, for the setup line."""
    return " (auto)" if setting == "auto" else ""


def _with_checkpoint_legacy(config: Config, run_dir: Path, dist: Distributed) -> Config:
    """``config`` for resuming ``run_dir``: the fields its latest checkpoint predates keep the
    value they had then (``pipeline.config.with_legacy_values``; a run written before
    ``model.vocab_multiple`` resumes with 1, the shape of its weights). The checkpoint is not
    verified here: resuming does that, and refuses what it must."""
    latest = latest_checkpoint(run_dir, warn=dist.is_main)
    try:
        saved = read_state(latest).config if latest is not None else None
    except (OSError, UserError):  # one that resuming will name
        saved = None
    if saved is None:
        return config
    config, adopted = with_legacy_values(config, saved)
    if adopted and dist.is_main:
        log.info("resuming a checkpoint written before these fields existed: %s, as it was trained",
                 "; ".join(adopted))
    return config


def _start(run_dir: Path, init_from: InitFrom | None, dist: Distributed) -> InitRecord | InitSource | None:
    """What the run's network starts from: with checkpoints, the record of the source its
    checkpoint names (its weights come from the checkpoint; ``recorded_source`` refuses another
    source); without, ``init_from``'s source, read on every rank (each builds its own module)."""
    recorded = recorded_source(run_dir, init_from)
    if recorded is not None or init_from is None:
        if recorded is not None and init_from is not None and dist.is_main:
            log.info("%s has checkpoints: resuming from its own, not reloading --init-from %s", run_dir,
                     recorded.source)
        return recorded
    source = read_source(init_from)
    if dist.is_main:
        log.info("starting from the %s; optimizer state fresh, EMA from these weights", source.record.summary())
    return source


def _first_tensor_mismatch(saved: CheckpointMeta, spec: ModelSpec) -> str | None:
    """The first weight whose name or shape differs between the network a checkpoint holds and
    ``spec``'s, named with both shapes; None when they agree. Built on the meta device: names
    and shapes only, nothing allocated."""
    theirs = model_spec(ModelSection(**saved.config["model"]), TransformerConfig(**saved.network))
    with torch.device("meta"):
        old, new = ({name: tuple(t.shape) for name, t in build_trainable(s, validate=False).state_dict().items()}
                    for s in (theirs, spec))
    for name in [*old, *(name for name in new if name not in old)]:
        if old.get(name) != new.get(name):
            return f"{name} is {_shape(old.get(name))} in the checkpoint and {_shape(new.get(name))} in this config"
    return None


def _shape(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else str(list(shape))


def _record_step(line: str) -> int:
    """The step of a metrics.jsonl line (a torn last line counts as after every step)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62


def _grad_norm(engine) -> float:
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")


def train(config: Config, *, data_dir: str | Path, run_dir: str | Path, resume: str = "auto",
          allow_config_change: bool = False, hooks: TrainHooks = TrainHooks(),
          init_from: InitFrom | None = None) -> TrainResult:
    """Train (or continue training) the run in ``run_dir`` on the shards in ``data_dir``.

    ``init_from`` starts a new run from another run's weights (``pipeline.training.init_from``): a run
    that already has checkpoints resumes from its own instead, and one started from another
    source is refused.

    ``hooks`` run on every rank: ``on_step`` after each step, ``on_checkpoint`` after each
    checkpoint is committed (the Ray Train launcher mirrors checkpoints to durable storage
    through it). A process group this call created is left at the end, by all ranks
    together; one that existed before (a launcher's) stays. Rank 0 first claims ``run_dir``
    as a run's (``common.outputs``: never the data, a prep, an export or a directory of
    other files) and takes its lock.
    """
    if resume not in ("auto", "never"):
        raise UserError(f"--resume must be 'auto' or 'never', got {resume!r}")
    joined_here = not torch.distributed.is_initialized()
    dist = init_distributed()
    try:
        lock, claim = _claim_run_dir(dist, data_dir, run_dir, init_from)
        try:
            data = data_dir if is_remote(data_dir) else Path(data_dir)
            result = _train_locked(config, dist, data, Path(run_dir), resume, allow_config_change, hooks, init_from)
        except BaseException:
            lock.release()
            if claim is not None and not _took_a_step(Path(run_dir)):  # a directory it created goes, with what it wrote
                claim.abandon(written=[path.name for path in RunLayout(run_dir).before_first_step()])
            raise
        lock.release()
    finally:  # a lone process's RANK, MASTER_PORT, ...: nothing it starts later may rendezvous on that port
        dist.unset_variables()
    if joined_here:  # the group this call made; a launcher's (Ray Train's) is the launcher's to end
        dist.shutdown()
    return result


def _claim_run_dir(dist: Distributed, data_dir: str | Path, run_dir: str | Path,
                   init_from: InitFrom | None) -> tuple[RunLock, OutputClaim | None]:
    """Rank 0 claims ``run_dir`` as a run's and takes its lock; every rank raises its refusal."""
    lock = RunLock(run_dir)
    refusal, claim = None, None
    if dist.is_main:
        try:
            local_data = [] if is_remote(data_dir) else [training_data(data_dir)]
            claim = claim_output_dir(run_dir, RUN_KIND, "--run-dir", [*local_data, *init_inputs(init_from)])
            lock.acquire()
        except UserError as err:
            refusal = err
    if dist.any(refusal is not None):
        raise refusal or UserError(f"{run_dir}: rank 0 could not lock the run directory; its message says why")
    return lock, claim


def _took_a_step(run_dir: Path) -> bool:
    """Whether the run directory holds a training step's work: a checkpoint, or the records of
    a step after the untrained validation at step 0 (a torn last line counts as one)."""
    layout = RunLayout(run_dir)
    if latest_checkpoint(run_dir, warn=False) is not None:
        return True
    try:
        lines = layout.metrics.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return False
    return any(_record_step(line) >= 1 for line in lines)


def _train_locked(config: Config, dist: Distributed, data_dir: str | Path, run_dir: Path, resume: str,
                  allow_config_change: bool, hooks: TrainHooks, init_from: InitFrom | None) -> TrainResult:
    if resume == "auto":
        config = _with_checkpoint_legacy(config, run_dir, dist)
    trainer = Trainer(config, data_dir, run_dir, dist, hooks, _start(run_dir, init_from, dist))
    trainer.resume(resume, allow_config_change)
    trainer.write_run_files()
    trainer.start_tracking()
    try:
        return trainer.run()
    except BaseException:
        if trainer.tracker is not None:
            trainer.tracker.close("FAILED", wait_s=FAILED_CLOSE_WAIT_S)
        raise
