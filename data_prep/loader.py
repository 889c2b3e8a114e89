"""The streaming loader: ``LongTensor[batch, seq_len]`` batches from the shards of a split.

Order of an epoch (a pure function of the manifest, the seed and the epoch number):
- the split's shards in a permutation drawn from (seed, epoch), each shard's sequences in
  chunk order with the rows of every chunk permuted by (seed, epoch, shard, chunk): one
  stream of sequences;
- rank r of W gets the r-th of W equal contiguous blocks of that stream, each a whole
  number of batches (the remainder, fewer than W * batch sequences, is left out), so every
  rank yields the same number of batches: uneven ranks would hang distributed training;
- within a rank, batch b is the b-th run of ``batch_size`` sequences of its block.
  DataLoader worker w of K builds batches B + w, B + w + K, ... where B is where the epoch
  resumes, so the rank sees the same batches in the same order for any K.

Shards are read with WebDataset's tar iterator (``data_prep.shards.iter_chunks``). A rank
reads only the shards its block overlaps. The last sequence of a split is padded (see the
manifest) and is left out unless ``drop_padded_tail=False``.

Integrity: before a process first reads a shard, its size and sha256 are checked against the
manifest (``data_prep.shards.verify_shard``), so a truncated or altered shard stops the run
with its name instead of training on garbage. The check costs one extra read of each shard
per process (DataLoader workers are new processes each epoch; BENCHMARKS.md has the cost);
``verify=False`` skips it.

``state_dict()`` is ``(epoch, batches consumed)``; a loader restored from it yields exactly
the batches an uninterrupted one would have yielded next.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from common.errors import UserError
from data_prep.shards import Manifest, ShardInfo, iter_chunks, verify_shard

__all__ = ["StreamingLoader"]

# Batches each DataLoader worker keeps ready (torch's default is 2).
PREFETCH_BATCHES = 4
# Shards this process has checked against the manifest: (path, sha256).
_VERIFIED: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class _Plan:
    """What a worker process needs to rebuild the stream (picklable)."""

    data_dir: str
    shards: tuple[ShardInfo, ...]
    counts: tuple[int, ...]     # usable sequences per shard (padded tail excluded)
    seq_len: int
    dtype: str
    batch_size: int
    rank: int
    world_size: int
    batches_per_rank: int
    seed: int
    shuffle: bool
    verify: bool

    def shard_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.shards))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))

    def rank_segments(self, epoch: int, start: int) -> Iterator[tuple[int, int, int, int]]:
        """(shard, first, stop, block position of first) covering this rank's block from
        ``start`` sequences on; positions within a shard are in its epoch order."""
        block = self.batches_per_rank * self.batch_size
        lo, hi = self.rank * block + start, (self.rank + 1) * block
        position = 0
        for shard in self.shard_order(epoch).tolist():
            count = self.counts[shard]
            first, stop = max(lo - position, 0), min(hi - position, count)
            if first < stop:
                yield shard, first, stop, position + first - self.rank * block
            position += count
            if position >= hi:
                return

    def rows(self, epoch: int, start: int) -> Iterator[tuple[int, np.ndarray]]:
        """(block position, rows [n, seq_len]) of this rank's block from ``start`` on."""
        for shard, first, stop, position in self.rank_segments(epoch, start):
            offset = 0
            for chunk_index, chunk in enumerate(self._chunks(shard)):
                lo, hi = max(first - offset, 0), min(stop - offset, len(chunk))
                if lo < hi:
                    if self.shuffle:
                        rng = np.random.default_rng([self.seed, epoch, shard, chunk_index])
                        chunk = chunk[rng.permutation(len(chunk))]
                    yield position + offset + lo - first, chunk[lo:hi]
                offset += len(chunk)
                if offset >= stop:
                    break

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

    def batches(self, epoch: int, first_batch: int, stride: int, offset: int) -> Iterator[torch.Tensor]:
        """Batches first_batch + offset, first_batch + offset + stride, ... of the epoch."""
        size = self.batch_size
        wanted = first_batch + offset
        parts: list[np.ndarray] = []
        for position, rows in self.rows(epoch, wanted * size):
            i = 0
            while i < len(rows) and wanted < self.batches_per_rank:
                batch, end = (position + i) // size, min(len(rows), (wanted + 1) * size - position)
                if batch == wanted:
                    parts.append(rows[i:end])
                    if position + end == (wanted + 1) * size:
                        yield torch.from_numpy(np.concatenate(parts).astype(np.int64))
                        parts, wanted = [], wanted + stride
                    i = end
                else:  # rows of a batch another worker builds
                    i = min(len(rows), wanted * size - position)


class _EpochStream(IterableDataset):
    def __init__(self, plan: _Plan, epoch: int, first_batch: int) -> None:
        self.plan, self.epoch, self.first_batch = plan, epoch, first_batch

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        stride, offset = (1, 0) if info is None else (info.num_workers, info.id)
        return self.plan.batches(self.epoch, self.first_batch, stride, offset)


class StreamingLoader:
    """Iterate a split in batches; one ``for`` loop over the loader is one epoch (or the
    rest of it, after ``load_state_dict``)."""

    def __init__(self, data_dir: str | Path, split: str, batch_size: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True, num_workers: int = 0,
                 pin_memory: bool = False, drop_padded_tail: bool = True, verify: bool = True) -> None:
        manifest = Manifest.read(data_dir)
        if split not in manifest.splits:
            raise UserError(f"split {split!r} not in {data_dir}; it has {sorted(manifest.splits)}")
        if batch_size < 1 or not 0 <= rank < world_size or num_workers < 0:
            raise UserError(f"bad loader arguments: batch_size={batch_size}, rank={rank}, "
                            f"world_size={world_size}, num_workers={num_workers}")
        info = manifest.splits[split]
        counts = [shard.sequences for shard in info.shards]
        if drop_padded_tail and info.padding_tokens and counts:
            counts[-1] -= 1
        batches_per_rank = sum(counts) // (world_size * batch_size)
        if batches_per_rank == 0:
            raise UserError(f"{data_dir} split {split!r} has {sum(counts)} sequences: too few for "
                            f"{world_size} rank(s) x batch {batch_size}")
        self.plan = _Plan(str(data_dir), tuple(info.shards), tuple(counts), manifest.seq_len, manifest.dtype,
                          batch_size, rank, world_size, batches_per_rank, seed, shuffle, verify)
        self.data_sha256 = manifest.sha256()
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.epoch, self.batches = 0, 0

    def __len__(self) -> int:
        """Batches per epoch on every rank."""
        return self.plan.batches_per_rank

    def __iter__(self) -> Iterator[torch.Tensor]:
        stream = _EpochStream(self.plan, self.epoch, self.batches)
        extra = dict(prefetch_factor=PREFETCH_BATCHES) if self.num_workers else {}
        loader = DataLoader(stream, batch_size=None, num_workers=self.num_workers,
                            pin_memory=self.pin_memory, **extra)
        for batch in loader:
            self.batches += 1
            yield batch
        self.epoch, self.batches = self.epoch + 1, 0

    def state_dict(self) -> dict:
        plan = self.plan
        return {"epoch": self.epoch, "batches": self.batches, "seed": plan.seed, "shuffle": plan.shuffle,
                "batch_size": plan.batch_size, "rank": plan.rank, "world_size": plan.world_size,
                "data_sha256": self.data_sha256}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        differ = [f"{key}: checkpoint {state.get(key)!r}, now {mine[key]!r}"
                  for key in ("seed", "shuffle", "batch_size", "rank", "world_size", "data_sha256")
                  if state.get(key) != mine[key]]
        if differ:
            raise UserError("cannot resume the data loader: " + "; ".join(differ))
        if not 0 <= state["batches"] <= len(self):
            raise UserError(f"cannot resume the data loader at batch {state['batches']} of {len(self)}")
        self.epoch, self.batches = state["epoch"], state["batches"]
