"""The streaming loader: ``LongTensor[batch, seq_len]`` batches from the shards of a split.

Order of an epoch (a pure function of the manifest, the seed and the epoch number):
- the split's shards in a permutation drawn from (seed, epoch), each shard's sequences in
  chunk order with the rows of every chunk permuted by (seed, epoch, shard, chunk): one
  stream of sequences;
- global batch g is the sequences [g G, (g + 1) G) of that stream, G the global batch size
  (all ranks and micro-batches of an optimizer step); the remainder, fewer than G
  sequences, is left out. Which sequences form global batch g therefore does not depend
  on the number of ranks, so a run resumed on another number of ranks sees the same
  global batches;
- the G sequences of a global batch are W x A slots of ``batch_size`` sequences (W ranks,
  A micro-batches per rank): micro-batch m of rank r takes slot m W + r, the slot order of
  the training times (``pipeline.objective.MicroBatchSlot``). Every rank yields the same
  number of batches, A per global batch: uneven ranks would hang distributed training.
  DataLoader worker w of K builds batches B + w, B + w + K, ... where B is where the epoch
  resumes, so the rank sees the same batches in the same order for any K.

Cost of that order: a rank's sequences are spread over the whole stream, so every rank
reads every chunk of the epoch and keeps 1 / W of its rows (BENCHMARKS.md has the rate).
A shard holding none of a rank's sequences is not opened.

Shards are read with WebDataset's tar iterator (``data_prep.shards.iter_chunks``). The last
sequence of a split is padded (see the manifest) and is left out unless
``drop_padded_tail=False``.

Integrity: before a process first reads a shard, its size and sha256 are checked against the
manifest (``data_prep.shards.verify_shard``), so a truncated or altered shard stops the run
with its name instead of training on garbage. A DataLoader worker hands such a ``UserError``
to the main process, which raises it as itself: one line, whatever the number of workers. The check costs one extra read of each shard
per process (DataLoader workers are new processes each epoch; BENCHMARKS.md has the cost);
``verify=False`` skips it.

``state_dict()`` is the position in global batches (epoch, global batches consumed, and the
micro-batches of the next one this rank consumed): a loader restored from it yields exactly
the batches an uninterrupted one would have yielded next, on any number of ranks and
micro-batch size with the same global batch size (at a global batch boundary, which is
where training checkpoints).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from common.errors import UserError
from data_prep.shards import Manifest, ShardInfo, iter_chunks, verify_shard

__all__ = ["StreamingLoader"]

log = logging.getLogger("unmask.loader")

# Batches each DataLoader worker keeps ready (torch's default is 2).
PREFETCH_BATCHES = 4
# Shards this process has checked against the manifest: (path, sha256).
_VERIFIED: set[tuple[str, str]] = set()
# What a loader's position must agree on to be resumed (the number of ranks and the
# micro-batch size may differ).
_RESUME_KEYS = ("seed", "shuffle", "global_batch_size", "data_sha256")


@dataclass(frozen=True)
class _Plan:
    """What a worker process needs to rebuild the stream (picklable)."""

    data_dir: str
    shards: tuple[ShardInfo, ...]
    counts: tuple[int, ...]     # usable sequences per shard (padded tail excluded)
    seq_len: int
    dtype: str
    batch_size: int             # sequences per batch of this rank (a micro-batch)
    rank: int
    world_size: int
    global_batch_size: int      # sequences per global batch: world_size x micro_batches x batch_size
    global_batches: int         # per epoch
    seed: int
    shuffle: bool
    verify: bool

    @property
    def micro_batches(self) -> int:
        """Batches of this rank per global batch."""
        return self.global_batch_size // (self.world_size * self.batch_size)

    @property
    def batches_per_epoch(self) -> int:
        return self.global_batches * self.micro_batches

    def batch_start(self, index: int) -> int:
        """Stream position of the first sequence of this rank's batch ``index`` of an epoch."""
        global_batch, micro = divmod(index, self.micro_batches)
        slot = micro * self.world_size + self.rank
        return global_batch * self.global_batch_size + slot * self.batch_size

    def shard_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.shards))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))

    def shard_positions(self, epoch: int) -> Iterator[tuple[int, int]]:
        """(shard, stream position of its first sequence) in the epoch's order."""
        position = 0
        for shard in self.shard_order(epoch).tolist():
            yield shard, position
            position += self.counts[shard]

    def batches(self, epoch: int, first_batch: int, stride: int, offset: int) -> Iterator[torch.Tensor]:
        """Batches first_batch + offset, first_batch + offset + stride, ... of the epoch,
        gathered in one pass over the stream (their positions only grow)."""
        starts = (self.batch_start(i) for i in range(first_batch + offset, self.batches_per_epoch, stride))
        start, parts, filled = next(starts, None), [], 0
        for shard, chunk_first in self.shard_positions(epoch):
            if start is None:
                return
            shard_stop = chunk_first + self.counts[shard]
            if start >= shard_stop:
                continue  # none of the wanted sequences lie in this shard: it is not opened
            for chunk_index, chunk in enumerate(self._chunks(shard)):
                chunk_stop = chunk_first + len(chunk)
                if start + filled < chunk_stop:  # the next wanted sequence lies in this chunk
                    rows = self._permuted(chunk, epoch, shard, chunk_index)
                while start is not None and start + filled < chunk_stop:
                    lo, hi = start + filled - chunk_first, min(start + self.batch_size, chunk_stop) - chunk_first
                    parts.append(rows[lo:hi])
                    filled += hi - lo
                    if filled == self.batch_size:
                        yield torch.from_numpy(np.concatenate(parts).astype(np.int64))
                        start, parts, filled = next(starts, None), [], 0
                chunk_first = chunk_stop
                if start is None or start >= shard_stop:
                    break  # the rest of the shard holds none of the wanted sequences

    def _permuted(self, chunk: np.ndarray, epoch: int, shard: int, chunk_index: int) -> np.ndarray:
        if not self.shuffle:
            return chunk
        return chunk[np.random.default_rng([self.seed, epoch, shard, chunk_index]).permutation(len(chunk))]

    def _chunks(self, shard: int) -> Iterator[np.ndarray]:
        info = self.shards[shard]
        path = Path(self.data_dir) / info.path
        if self.verify and (str(path), info.sha256) not in _VERIFIED:
            verify_shard(self.data_dir, info)
            _VERIFIED.add((str(path), info.sha256))
        try:
            with open(path, "rb") as stream:
                for chunk in iter_chunks(stream, str(path)):
                    if chunk.ndim != 2 or chunk.shape[1] != self.seq_len or chunk.dtype.str != self.dtype:
                        raise UserError(f"{path}: chunk of shape {chunk.shape} and dtype {chunk.dtype.str}, "
                                        f"the manifest says [*, {self.seq_len}] {self.dtype}; rerun `unmask prep`")
                    yield chunk
        except FileNotFoundError:
            raise UserError(f"{path}: shard listed in the manifest is missing; rerun `unmask prep`") from None


@dataclass(frozen=True)
class _WorkerFailure:
    """A user's mistake met in a DataLoader worker (a corrupt shard), sent to the main process
    as an item of the stream: raised there as itself, the one line it is. Raised in the
    worker, DataLoader would re-raise it with the worker's traceback folded into its message."""

    error: UserError


class _EpochStream(IterableDataset):
    def __init__(self, plan: _Plan, epoch: int, first_batch: int) -> None:
        self.plan, self.epoch, self.first_batch = plan, epoch, first_batch

    def __iter__(self) -> Iterator[torch.Tensor | _WorkerFailure]:
        info = get_worker_info()
        if info is None:
            return self.plan.batches(self.epoch, self.first_batch, 1, 0)
        return self._in_worker(info.num_workers, info.id)

    def _in_worker(self, stride: int, offset: int) -> Iterator[torch.Tensor | _WorkerFailure]:
        try:
            yield from self.plan.batches(self.epoch, self.first_batch, stride, offset)
        except UserError as err:
            yield _WorkerFailure(err)


class StreamingLoader:
    """Iterate a split in batches; one ``for`` loop over the loader is one epoch (or the
    rest of it, after ``load_state_dict``). ``global_batch_size`` (default: ``batch_size``
    x ``world_size``, no accumulation) must be a multiple of ``batch_size`` x ``world_size``."""

    def __init__(self, data_dir: str | Path, split: str, batch_size: int, *, rank: int = 0,
                 world_size: int = 1, global_batch_size: int | None = None, seed: int = 0, shuffle: bool = True,
                 num_workers: int = 0, pin_memory: bool = False, drop_padded_tail: bool = True,
                 verify: bool = True) -> None:
        manifest = Manifest.read(data_dir)
        if split not in manifest.splits:
            raise UserError(f"split {split!r} not in {data_dir}; it has {sorted(manifest.splits)}")
        global_batch_size = global_batch_size or batch_size * world_size
        if (batch_size < 1 or not 0 <= rank < world_size or num_workers < 0
                or global_batch_size % (batch_size * world_size)):
            raise UserError(f"bad loader arguments: batch_size={batch_size}, rank={rank}, world_size={world_size}, "
                            f"global_batch_size={global_batch_size}, num_workers={num_workers}")
        info = manifest.splits[split]
        counts = [shard.sequences for shard in info.shards]
        if drop_padded_tail and info.padding_tokens and counts:
            counts[-1] -= 1
        global_batches = sum(counts) // global_batch_size
        if global_batches == 0:
            raise UserError(f"{data_dir} split {split!r} has {sum(counts)} sequences: too few for a global batch "
                            f"of {global_batch_size} ({world_size} rank(s) x batch {batch_size} x "
                            f"{global_batch_size // (batch_size * world_size)} micro-batches)")
        self.plan = _Plan(str(data_dir), tuple(info.shards), tuple(counts), manifest.seq_len, manifest.dtype,
                          batch_size, rank, world_size, global_batch_size, global_batches, seed, shuffle, verify)
        self.data_sha256 = manifest.sha256()
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.epoch, self.batches = 0, 0

    def __len__(self) -> int:
        """Batches per epoch on every rank."""
        return self.plan.batches_per_epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        stream = _EpochStream(self.plan, self.epoch, self.batches)
        extra = dict(prefetch_factor=PREFETCH_BATCHES) if self.num_workers else {}
        loader = DataLoader(stream, batch_size=None, num_workers=self.num_workers,
                            pin_memory=self.pin_memory, **extra)
        for batch in loader:
            if isinstance(batch, _WorkerFailure):
                raise batch.error
            self.batches += 1
            yield batch
        self.epoch, self.batches = self.epoch + 1, 0

    def rewind(self) -> None:
        """Start over at the first batch of epoch 0."""
        self.epoch, self.batches = 0, 0

    def state_dict(self) -> dict:
        """Where the stream stands (epoch, batches consumed) and what it reads, for
        ``load_state_dict``."""
        plan = self.plan
        global_batches, micro_batches = divmod(self.batches, plan.micro_batches)
        return {"epoch": self.epoch, "global_batches": global_batches, "micro_batches": micro_batches,
                "global_batch_size": plan.global_batch_size, "seed": plan.seed, "shuffle": plan.shuffle,
                "data_sha256": self.data_sha256, "batch_size": plan.batch_size, "world_size": plan.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (of this or another number of ranks, see the module docstring)."""
        plan, mine = self.plan, self.state_dict()
        if "global_batches" not in state:
            state = self._from_earlier_version(state)
        differ = [f"{key}: checkpoint {state.get(key)!r}, now {mine[key]!r}"
                  for key in _RESUME_KEYS if state.get(key) != mine[key]]
        if differ:
            raise UserError("cannot resume the data loader: " + "; ".join(differ))
        if state["micro_batches"] and (state["batch_size"], state["world_size"]) != (plan.batch_size, plan.world_size):
            raise UserError(f"cannot resume the data loader inside global batch {state['global_batches']} "
                            f"(after {state['micro_batches']} of its micro-batches) on another number of ranks "
                            "or micro-batch size; resume it at a global batch boundary")
        if not 0 <= state["global_batches"] <= plan.global_batches:
            raise UserError(f"cannot resume the data loader at global batch {state['global_batches']} "
                            f"of {plan.global_batches}")
        self.epoch = state["epoch"]
        self.batches = state["global_batches"] * plan.micro_batches + state["micro_batches"]

    def _from_earlier_version(self, state: dict) -> dict:
        """A position of a loader before global batches: the batches this rank consumed, in an
        order of W contiguous blocks. It maps onto the same number of global batches; with
        several ranks the rest of that epoch then follows this version's order, and may
        repeat or skip some of its sequences."""
        plan = self.plan
        if (state.get("batch_size"), state.get("world_size")) != (plan.batch_size, plan.world_size):
            raise UserError(f"cannot resume the data loader of an earlier version (batch {state.get('batch_size')} "
                            f"on {state.get('world_size')} ranks) with batch {plan.batch_size} on "
                            f"{plan.world_size} ranks; resume it with the number of ranks it was written by")
        if plan.world_size > 1:
            log.warning("the data loader's position comes from an earlier version, which ordered the data per "
                        "rank: epoch %d continues in this version's order, which may repeat or skip some of "
                        "its sequences", state["epoch"])
        global_batches, micro_batches = divmod(state["batches"], plan.micro_batches)
        return {**state, "global_batch_size": plan.global_batch_size,
                "global_batches": min(global_batches, plan.global_batches), "micro_batches": micro_batches}
