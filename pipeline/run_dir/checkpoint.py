"""Checkpoints: DeepSpeed's layout plus our own state, committed only when complete.

    RUN/checkpoints/step-00000100/   DeepSpeed's model and optimizer files (every rank)
        rank-00000.pt                 this rank's EMA and RNG states (``pipeline.run_dir.rank_files``)
        unmask_state.json             ``CheckpointMeta``: step, tokens, loader position, config,
                                      hashes, and the size and sha256 of every other file (rank 0, last)
        universal/                    added by a resume on another number of ranks (``reshard``)
    RUN/checkpoints/latest            "step-00000100", moved after every rank finished

What a caller relies on: ``latest`` names a complete checkpoint, or is a broken pointer that
every reader replaces by the newest complete checkpoint, with a warning
(:func:`latest_checkpoint`); a checkpoint whose files differ from their records is never
loaded (:func:`verify_checkpoint`; resume falls back to the newest intact one); every torch
file is read with ``safe_load``; a state file of an earlier unmask is refused in one line
(:class:`EarlierCheckpoint`). The manual: docs/training.md#checkpoints-and-resume.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from common.atomic_files import atomic_write_bytes
from common.disk_full import DiskFull, is_disk_full
from common.errors import UserError
from common.file_records import HASH_THREADS, sha256_file
from pipeline.distributed import Distributed
from pipeline.run_dir.layout import TAG_PATTERN, RunLayout
from pipeline.run_dir.rank_files import rank_file, rng_state, set_rng_state
from pipeline.run_dir.reshard import DEEPSPEED_DIR, EMA_FILE, UNIVERSAL_DIR, universal_checkpoint, universal_loading
from pipeline.run_dir.safe_load import deepspeed_loads_safely, find_unloadable, load_torch_file

__all__ = [
    "STATE_FILE",
    "CheckpointManager",
    "CheckpointMeta",
    "EMAState",
    "EarlierCheckpoint",
    "TrainState",
    "intact_checkpoint",
    "latest_checkpoint",
    "latest_step",
    "read_state",
    "resolve_checkpoint",
    "set_latest",
    "verify_checkpoint",
    "write_failure",
]

log = logging.getLogger("unmask.checkpoint")

STATE_FILE = "unmask_state.json"
# Scripts DeepSpeed copies beside every save. They unpickle the checkpoint with
# weights_only off, so a run dir shared with them invites running code from a file someone
# received; `unmask export` does their job safely. Removed after each save.
DEEPSPEED_RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


class EarlierCheckpoint(UserError):
    """A checkpoint written by an earlier unmask, whose format this one does not read."""


class EMAState(Protocol):
    """What a checkpoint saves and restores of the EMA (``pipeline.training.ema.EMA``)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def load_full_state(self, shadow: dict[str, Tensor], updates: int) -> None: ...


@dataclass
class TrainState:
    """What the loop needs, beyond weights and optimizer, to continue exactly."""

    step: int = 0                  # optimizer steps taken
    tokens_seen: int = 0           # training tokens consumed, all ranks
    skipped_steps: int = 0         # steps whose gradients were not finite
    consecutive_skipped: int = 0
    loader: dict | None = None     # StreamingLoader.state_dict() (the same on every rank)
    block_mask_rate: list[float] | None = None  # the interval train.block_mask_rate_search chose last


@dataclass(frozen=True)
class CheckpointMeta:
    """``unmask_state.json``: the loop's state at the checkpoint and what the run was made
    of (config, data, tokenizer, network, how it ran), so that a resume or an export can
    check and rebuild it; ``files`` records every other file of the checkpoint."""

    state: TrainState
    config: dict                   # Config.to_dict() of the run
    config_sha256: str
    data_sha256: str               # of the data's manifest.json
    tokenizer_sha256: str
    network: dict                  # the TransformerConfig's fields
    zero_stage: int
    precision: str
    batch_plan: dict               # BatchPlan's fields
    world_size: int
    files: dict[str, dict] = field(default_factory=dict)   # name -> {"bytes", "sha256"}, set on commit
    # Where a run started with --init-from took its first weights (pipeline.training.init_from.InitRecord);
    # None: from scratch.
    init_from: dict | None = None

    @property
    def step(self) -> int:
        return self.state.step

    def to_json(self) -> str:
        """One flat object: the state's fields next to the others."""
        record = {**asdict(self.state), **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "state"}}
        return json.dumps(record, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, path: Path) -> "CheckpointMeta":
        """The metadata in ``text`` (of ``path``); every field must be there: a state file
        without some was written by an earlier unmask (:class:`EarlierCheckpoint`)."""
        record = json.loads(text)
        if not isinstance(record, dict):
            raise UserError(f"{path}: not an unmask checkpoint state (a JSON {type(record).__name__})")
        state_keys = [f.name for f in fields(TrainState)]
        missing = [key for key in [*state_keys, *(f.name for f in fields(cls) if f.name != "state")]
                   if key not in record]
        if missing:
            raise EarlierCheckpoint(f"{path}: written by an earlier unmask (no {missing[0]}); train again in a new "
                                    f"--run-dir")
        state = TrainState(**{k: record[k] for k in state_keys})
        try:
            return cls(state=state, **{k: v for k, v in record.items() if k not in state_keys})
        except TypeError as err:
            raise UserError(f"{path}: not an unmask checkpoint state ({err})") from None


# ----------------------------------------------------------------------------- integrity
def _file_records(directory: Path) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes", "sha256"}}`` of every file of a checkpoint but its state file."""
    paths = sorted(p for p in directory.iterdir() if p.is_file() and p.name != STATE_FILE)
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        digests = list(pool.map(sha256_file, paths))
    return {p.name: {"bytes": p.stat().st_size, "sha256": d} for p, d in zip(paths, digests)}


def read_state(directory: Path) -> CheckpointMeta:
    """The metadata of the checkpoint in ``directory``."""
    path = directory / STATE_FILE
    if not path.is_file():
        raise UserError(f"{directory}: not a complete unmask checkpoint (no {STATE_FILE})")
    try:
        return CheckpointMeta.from_json(path.read_text(), path)
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: truncated or corrupt ({err}); use an earlier checkpoint of the run") from None


def verify_checkpoint(directory: Path) -> str | None:
    """Why ``directory`` cannot be trusted (a missing, truncated or altered file), or None.
    A checkpoint of an earlier unmask is not a broken one: :class:`EarlierCheckpoint` is raised."""
    try:
        records = read_state(directory).files
    except EarlierCheckpoint:
        raise
    except UserError as err:
        return str(err)
    for name, record in records.items():
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != record["bytes"]:
            return f"{path} has {size} bytes, {record['bytes']} were written (truncated or overwritten)"
    paths = [directory / name for name in records]
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        for path, digest in zip(paths, pool.map(sha256_file, paths)):
            if digest != records[path.name]["sha256"]:
                return f"{path}: its sha256 differs from the one recorded when it was written (corrupt)"
    return None


def _complete_tags(layout: RunLayout) -> list[str]:
    """Checkpoint directories with a state file, newest first."""
    if not layout.checkpoints.is_dir():
        return []
    tags = [d.name for d in layout.checkpoints.iterdir() if TAG_PATTERN.match(d.name) and (d / STATE_FILE).is_file()]
    return sorted(tags, reverse=True)


# Characters of a broken pointer's text that its warning shows.
POINTER_SHOWN_CHARS = 80
# The broken pointers warned about already by this process (path, text): one warning each.
_WARNED_POINTERS: set[tuple[str, str]] = set()


def _pointer_problem(layout: RunLayout, text: str | None) -> str | None:
    """What is wrong with ``latest`` holding ``text`` (None: the file is missing), or None."""
    if text is None:
        return f"{layout.latest} is missing" if _complete_tags(layout) else None
    if not text.strip():
        return f"{layout.latest} is empty"
    tag = text.strip()
    if TAG_PATTERN.match(tag) is None:
        return f"{layout.latest} holds {tag[:POINTER_SHOWN_CHARS]!r}, not the name of a checkpoint of this run"
    if not (layout.checkpoints / tag / STATE_FILE).is_file():
        return f"{layout.latest} names {tag}, which is not a complete checkpoint"
    return None


def latest_checkpoint(run_dir: Path, *, warn: bool = True) -> Path | None:
    """The checkpoint the run's ``latest`` names; None before the first. A broken pointer
    (module docstring) gives the newest complete checkpoint found by scanning instead, with
    a warning that names the pointer (once per process; none with ``warn`` off: the ranks
    but rank 0 of a job)."""
    layout = RunLayout(run_dir)
    try:
        text = layout.latest.read_text(encoding="utf-8", errors="replace") if layout.latest.is_file() else None
    except OSError:
        text = ""
    problem = _pointer_problem(layout, text)
    if problem is None:
        return layout.checkpoints / text.strip() if text is not None else None
    found = _complete_tags(layout)
    if warn and (str(layout.latest), text or "") not in _WARNED_POINTERS:
        _WARNED_POINTERS.add((str(layout.latest), text or ""))
        log.warning("%s; using %s instead, the newest complete checkpoint found in %s (the next checkpoint "
                    "saved rewrites the pointer)", problem, found[0] if found else "none", layout.checkpoints)
    return layout.checkpoints / found[0] if found else None


def intact_checkpoint(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint at or before ``latest`` (``latest_checkpoint``) that verifies,
    and why each newer one was passed over."""
    layout = RunLayout(run_dir)
    pointed = latest_checkpoint(run_dir)
    if pointed is None:
        return None, []
    newest = pointed.name
    broken = []
    for tag in [t for t in _complete_tags(layout) if t <= newest] or [newest]:
        problem = verify_checkpoint(layout.checkpoints / tag)
        if problem is None:
            return layout.checkpoints / tag, broken
        broken.append(f"{tag}: {problem}")
    return None, broken


def resolve_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The directory of checkpoint ``step`` of a run, or of its latest one."""
    layout = RunLayout(run_dir)
    if step is not None:
        directory = layout.checkpoint(step)
        if not (directory / STATE_FILE).is_file():
            have = sorted(int(TAG_PATTERN.match(t).group(1)) for t in _complete_tags(layout))
            raise UserError(f"{run_dir}: no complete checkpoint at step {step}; available: {have or 'none'}")
        return directory
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise UserError(f"{run_dir}: no checkpoint yet ({layout.latest} is missing); train first")
    return latest


def latest_step(run_dir: Path) -> int | None:
    """The step of the run's latest checkpoint (``latest_checkpoint``), or None before the first."""
    latest = latest_checkpoint(run_dir)
    return int(TAG_PATTERN.match(latest.name).group(1)) if latest is not None else None


def set_latest(run_dir: Path, tag: str) -> None:
    """Point the run's ``latest`` at checkpoint ``tag`` (atomically: a reader sees old or new)."""
    atomic_write_bytes(RunLayout(run_dir).latest, tag.encode())


# ----------------------------------------------------------------------------- failures
def write_failure(err: BaseException, path: Path, run_dir: Path) -> UserError:
    """One line for a failed write during training: disk full (with the last intact
    checkpoint to resume from), or the error itself with the file it was writing."""
    intact, _ = intact_checkpoint(run_dir)
    resume = f"the last intact checkpoint is {intact}" if intact else "no intact checkpoint was written yet"
    if is_disk_full(err, path if path.is_dir() else path.parent):
        return DiskFull(f"No space left on device while writing {path}; {resume}. Free space (or move "
                        f"the run to a bigger disk) and rerun the same command with --resume auto")
    return UserError(f"writing {path} failed ({type(err).__name__}: {err}); {resume}")


# ----------------------------------------------------------------------------- loading
def _load_engine(engine, root: Path, tag: str) -> None:
    """``engine.load_checkpoint(root, tag)`` with every torch file read safely; a failure
    names the file that could not be read, when one could not."""
    directory = root / tag
    try:
        with deepspeed_loads_safely():
            load_path, _ = engine.load_checkpoint(str(root), tag=tag)
    except Exception as err:  # DeepSpeed does not say which file it was reading
        culprit = find_unloadable(directory)
        if culprit is not None:
            raise culprit from None
        raise UserError(f"{directory}: DeepSpeed could not load this checkpoint ({type(err).__name__}: "
                        f"{err})") from err
    if load_path is None:
        raise UserError(f"{directory}: DeepSpeed could not load this checkpoint")


# ----------------------------------------------------------------------------- the manager
class CheckpointManager:
    """Saves and restores the engine, the EMA and the loop state of one run. ``asynchronous``:
    saves are written in the background (``pipeline.run_dir.async_checkpoint``; :meth:`poll` at
    each step boundary, :meth:`finish` before reading ``latest``). ``on_committed(directory, step)``
    runs on every rank once a checkpoint is committed; ``on_file_written(path, step)`` in the writing
    thread after each file of an asynchronous save (``TrainHooks.on_checkpoint_file``)."""

    def __init__(self, run_dir: Path, dist: Distributed, keep_last: int, *, asynchronous: bool = False,
                 on_committed: Callable[[Path, int], None] | None = None,
                 on_file_written: Callable[[Path, int], None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.layout = RunLayout(run_dir)
        self.root = self.layout.checkpoints
        self.dist, self.keep_last = dist, keep_last
        self.on_committed = on_committed or (lambda directory, step: None)
        self.on_file_written = on_file_written or (lambda path, step: None)
        self.saves = None
        if asynchronous:
            # Here, not at the top: the module imports DeepSpeed, which a command that never trains
            # must not load (it logs its accelerator on import).
            from pipeline.run_dir.async_checkpoint import AsyncSaves

            self.saves = AsyncSaves(dist, self._failure, self.on_committed)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.run_dir, warn=self.dist.is_main)

    def newest_intact(self) -> Path | None:
        """The checkpoint to resume from, decided by rank 0 (which verifies the files) and
        the same on every rank; each newer, broken one is named in a warning. With none
        intact (or one of an earlier unmask), every rank raises the one message that says so
        (and nothing is resumed)."""
        chosen, refusal = None, None
        if self.dist.is_main:
            try:
                intact, broken = intact_checkpoint(self.run_dir)
            except EarlierCheckpoint as err:
                intact, broken, refusal = None, [], err
            if broken and intact is None:
                refusal = UserError(f"{self.root}: no intact checkpoint to resume from ({'; '.join(broken)}); restore "
                                    f"them, or move the checkpoints away to start over")
            for problem in broken if intact is not None else ():
                log.warning("checkpoint %s: not used; resuming from %s instead", problem, intact.name)
            chosen = intact.name if intact else None
        if self.dist.any(refusal is not None):
            raise refusal or UserError(f"{self.root}: no intact checkpoint to resume from; rank 0's message says why")
        chosen = self.dist.broadcast(chosen)
        return self.root / chosen if chosen else None

    def save(self, engine, ema: EMAState, meta: CheckpointMeta) -> Path:
        """Write checkpoint ``meta.step`` on every rank; commit it with ``latest`` (asynchronous: start to)."""
        if self.saves is not None:
            return self._start_save(engine, ema, meta)
        directory = self.layout.checkpoint(meta.step)
        failure: BaseException | None = None
        try:
            if self.dist.is_main and directory.exists():
                shutil.rmtree(directory)  # a half-written save of this step by a killed run
            self.dist.barrier()
            engine.save_checkpoint(str(self.root), tag=directory.name, save_latest=False)
            directory.mkdir(parents=True, exist_ok=True)
            torch.save({"ema": ema.state_dict(), "rng": rng_state()}, rank_file(directory, self.dist.rank))
        except (OSError, RuntimeError) as err:
            failure = err
        self._raise_if_any_failed(failure, directory)
        if self.dist.is_main:
            try:
                self._commit(directory, replace(meta, world_size=self.dist.world_size))
            except OSError as err:
                failure = err
        self._raise_if_any_failed(failure, directory)
        self.on_committed(directory, meta.step)
        return directory

    def _start_save(self, engine, ema: EMAState, meta: CheckpointMeta) -> Path:
        """Take the snapshot of checkpoint ``meta.step`` (the step waits for this only), then write
        and commit it in the background, after the save in flight."""
        from pipeline.run_dir.async_checkpoint import capture_engine_state, host_copy

        self.saves.finish()
        directory, failure = self.layout.checkpoint(meta.step), None
        try:
            if self.dist.is_main and directory.exists():
                shutil.rmtree(directory)  # a half-written save of this step by a killed run
            self.dist.barrier()
            snapshot = capture_engine_state(engine, self.root, directory.name)
            directory.mkdir(parents=True, exist_ok=True)
            rank_state = host_copy({"ema": ema.state_dict(), "rng": rng_state()})
        except (OSError, RuntimeError) as err:
            failure = err
        self._raise_if_any_failed(failure, directory)
        path, meta = rank_file(directory, self.dist.rank), replace(meta, world_size=self.dist.world_size)

        def write() -> None:
            snapshot.write(lambda written: self.on_file_written(written, meta.step))
            torch.save(rank_state, path)
            self.on_file_written(path, meta.step)

        self.saves.start(directory, meta.step, write, lambda: self._commit(directory, meta))
        return directory

    def poll(self) -> None:
        """Move the asynchronous save in flight on (every rank, at a step boundary)."""
        if self.saves is not None:
            self.saves.poll()

    def finish(self) -> None:
        """Wait until the asynchronous save in flight is committed (every rank)."""
        if self.saves is not None:
            self.saves.finish()

    def settle_after_failure(self) -> None:
        """A run is failing: alone, it still commits the save in flight (its state is sound);
        with other ranks it cannot (they may not reach the collectives), and commits nothing."""
        if self.saves is None:
            return
        if self.dist.world_size > 1:
            self.saves.abandon()
            return
        try:
            self.saves.finish()
        except UserError as err:
            log.error("%s", err)

    def _commit(self, directory: Path, meta: CheckpointMeta) -> None:
        for script in DEEPSPEED_RECOVERY_SCRIPTS:
            (self.root / script).unlink(missing_ok=True)
        recorded = replace(meta, files=_file_records(directory))
        atomic_write_bytes(directory / STATE_FILE, recorded.to_json().encode())
        set_latest(self.run_dir, directory.name)
        self._prune()

    def _raise_if_any_failed(self, failure: BaseException | None, directory: Path) -> None:
        """All ranks stop together when one could not write (none waits at a barrier)."""
        if not self.dist.any(failure is not None):
            self.dist.barrier()
            return
        raise self._failure(failure, directory) from failure

    def _failure(self, failure: BaseException | None, directory: Path) -> UserError:
        """The error every rank raises when one could not write ``directory`` (``failure``: this
        rank's, or None); rank 0 removes the partial checkpoint."""
        error = UserError(f"another rank failed to write checkpoint {directory}; see its message") \
            if failure is None else write_failure(failure, directory, self.run_dir)  # before space is freed
        if self.dist.is_main:
            shutil.rmtree(directory, ignore_errors=True)  # frees the space a partial save took
        return error

    def load(self, engine, ema: EMAState, directory: Path) -> CheckpointMeta:
        """Restore engine, EMA and RNG from ``directory``; return its metadata. A checkpoint of
        another number of ranks goes through its universal form (``pipeline.run_dir.reshard``); each
        rank then takes the RNG states of the rank it stands for modulo the old number (they
        only drive dropout: the loop's own draws are seeded by position)."""
        saved = read_state(directory)
        if saved.world_size == self.dist.world_size:
            _load_engine(engine, self.root, directory.name)
            rank_state = load_torch_file(rank_file(directory, self.dist.rank))
            ema.load_state_dict(rank_state["ema"])
        else:
            self._load_resharded(engine, ema, directory, saved)
            rank_state = load_torch_file(rank_file(directory, self.dist.rank % saved.world_size))
        set_rng_state(rank_state["rng"])
        return saved

    def _load_resharded(self, engine, ema: EMAState, directory: Path, saved: CheckpointMeta) -> None:
        """Engine and EMA from a checkpoint of ``saved.world_size`` ranks, converted by rank 0
        while the others wait (every rank reads the checkpoint directory)."""
        stage = engine.zero_optimization_stage()
        if stage != saved.zero_stage:
            raise UserError(f"{directory} was written under ZeRO-{saved.zero_stage}; on {self.dist.world_size} "
                            f"rank(s) this run resolves train.zero_stage to {stage}. Resume with --train.zero_stage "
                            f"{saved.zero_stage} --allow-config-change")
        failure = None
        if self.dist.is_main:
            log.info("%s was written by %d rank(s); resuming it on %d", directory.name, saved.world_size,
                     self.dist.world_size)
            try:
                universal_checkpoint(directory, [rank_file(directory, r) for r in range(saved.world_size)])
            except (UserError, OSError) as err:
                failure = err
        if self.dist.any(failure is not None):
            if failure is None:
                raise UserError(f"rank 0 could not convert {directory}; its message says why")
            raise failure if isinstance(failure, UserError) else write_failure(failure, directory, self.run_dir)
        universal = directory / UNIVERSAL_DIR
        with universal_loading(engine):
            _load_engine(engine, universal, DEEPSPEED_DIR)
        whole = load_torch_file(universal / EMA_FILE)
        ema.load_full_state(whole["shadow"], whole["updates"])

    def _prune(self) -> None:
        steps = sorted(int(m.group(1)) for d in self.root.iterdir() if (m := TAG_PATTERN.match(d.name)))
        complete = [s for s in steps if (self.layout.checkpoint(s) / STATE_FILE).is_file()]
        keep = set(complete[-self.keep_last:])
        for step in steps:
            if step not in keep and step < max(keep):
                shutil.rmtree(self.layout.checkpoint(step), ignore_errors=True)
