"""The streaming loader: ``LongTensor[batch, seq_len]`` batches from the shards of a split.

The order of an epoch is a pure function of the manifest, the seed, the epoch and the
shuffle window: the split's shards permuted, cut into windows, and each window's chunks
dealt into G lanes (G: the global batch size), so that a global batch takes one row of every
lane. Micro-batch m of rank r is slot m W + r of the global batch, the slot order of the
training times (``pipeline.training.objective.MicroBatchSlot``): the global batches do not
depend on the number of ranks, micro-batches or DataLoader workers, and every rank yields the
same number of batches. A rank reads only the chunks of its own lanes, and checks each
chunk's sha256 as it reads it; a ``UserError`` met in a DataLoader worker, or the
``StopRequested`` of a read that a signal stopped, reaches the caller as itself.
``state_dict()`` is the position in global batches: a loader restored from it yields exactly
the batches an uninterrupted one would have yielded next, on any number of ranks with the
same global batch size and window; a position of another order is refused.
The reasoning and the measurements: docs/data-at-scale.md.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from common.errors import UserError
from common.stop_request import StopRequested
from data_prep.shards.format import ShardInfo, decode_chunk
from data_prep.shards.storage import ChunkCache, ShardStore, read_manifest

__all__ = ["DEFAULT_SHUFFLE_WINDOW", "StreamingLoader"]

# Sequences per shuffle window: MosaicML Streaming's default block (2^18), which spans
# hundreds of shards; a split smaller than that is shuffled whole.
DEFAULT_SHUFFLE_WINDOW = 1 << 18
# Parts of global batches each DataLoader worker keeps ready (torch's default is 2).
PREFETCH_PARTS = 4
# Chunk reads in flight per process: range requests to a remote store overlap their latency.
READ_THREADS = 8
# The order of the data that a loader's position refers to, recorded in it (``state_dict``):
# a position of another order is refused, since it would not resume the batches that come next.
ORDER_VERSION = 2
# What a loader's position must agree on to be resumed (the number of ranks and the
# micro-batch size may differ).
_RESUME_KEYS = ("seed", "shuffle", "global_batch_size", "shuffle_window", "data_sha256")


@dataclass(frozen=True)
class _Piece:
    """Rows [lo, hi) of chunk ``chunk`` of shard ``shard`` (rows in their permuted order)."""

    shard: int
    chunk: int
    lo: int
    hi: int


@dataclass(frozen=True)
class _Windows:
    """An epoch's stream as arrays over its chunks, and its windows' pieces on demand (a
    corpus of a million chunks takes milliseconds, not a million objects)."""

    shard: np.ndarray    # [chunks]: the shard of each chunk, in stream order
    chunk: np.ndarray    # [chunks]: its index in that shard
    start: np.ndarray    # [chunks + 1]: stream position of each chunk's first row; the last is the end
    size: int            # sequences per window

    def __len__(self) -> int:
        return -(-int(self.start[-1]) // self.size)

    def __getitem__(self, window: int) -> list[_Piece]:
        """The pieces of ``window`` in stream order."""
        lo, hi = window * self.size, min((window + 1) * self.size, int(self.start[-1]))
        first = int(np.searchsorted(self.start, lo, side="right")) - 1
        stop = int(np.searchsorted(self.start, hi, side="left"))
        pieces = []
        for index in range(max(first, 0), min(stop, len(self.shard))):
            begin, end = int(self.start[index]), int(self.start[index + 1])
            if min(hi, end) > max(lo, begin):
                pieces.append(_Piece(int(self.shard[index]), int(self.chunk[index]), max(lo, begin) - begin,
                                     min(hi, end) - begin))
        return pieces


@dataclass(frozen=True)
class _StreamPlan:
    """What a worker process needs to rebuild the stream (picklable)."""

    store: ShardStore
    shards: tuple[ShardInfo, ...]
    usable_rows: tuple[np.ndarray, ...]  # per shard, the usable rows of each chunk (padded tail excluded)
    seq_len: int
    dtype: str
    batch_size: int             # sequences per batch of this rank (a micro-batch)
    rank: int
    world_size: int
    global_batch_size: int      # sequences per global batch: world_size x micro_batches x batch_size
    global_batches: int         # per epoch
    window_batches: int         # global batches per shuffle window
    seed: int
    shuffle: bool

    @property
    def micro_batches(self) -> int:
        """Batches of this rank per global batch."""
        return self.global_batch_size // (self.world_size * self.batch_size)

    @property
    def batches_per_epoch(self) -> int:
        return self.global_batches * self.micro_batches

    def rank_lanes(self) -> np.ndarray:
        """The lanes (places in a global batch) of this rank: its micro-batches' slots in order."""
        slots = np.arange(self.micro_batches) * self.world_size + self.rank
        return (slots[:, None] * self.batch_size + np.arange(self.batch_size)).reshape(-1)

    def part_lanes(self, part: int, parts: int) -> np.ndarray:
        """The lanes read by DataLoader worker ``part`` of ``parts``: a contiguous share of the rank's."""
        lanes = self.rank_lanes()
        return lanes[part * len(lanes) // parts:(part + 1) * len(lanes) // parts]

    def windows(self, epoch: int) -> "_Windows":
        """The epoch's stream (its chunks in order, cut after the last whole global batch),
        cut into windows on demand."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards)) if self.shuffle \
            else np.arange(len(self.shards))
        lengths = np.array([len(self.usable_rows[shard]) for shard in order.tolist()], dtype=np.int64)
        rows = np.concatenate([self.usable_rows[shard] for shard in order.tolist()] or [np.zeros(0, np.int64)])
        starts = np.concatenate([[0], np.cumsum(rows)])
        kept = int(np.searchsorted(starts, self.global_batches * self.global_batch_size, side="left"))
        shard = np.repeat(order, lengths)[:kept]
        chunk = (np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths))[:kept]
        stops = np.minimum(starts[1:kept + 1], self.global_batches * self.global_batch_size)
        return _Windows(shard, chunk, np.concatenate([starts[:kept], stops[-1:]]),
                        self.window_batches * self.global_batch_size)

    def window_batches_of(self, window: int) -> int:
        return min(self.window_batches, self.global_batches - window * self.window_batches)

    def drawn(self, epoch: int, window: int, pieces: list[_Piece]) -> tuple[list[_Piece], np.ndarray]:
        """The window's pieces in their drawn order, and sigma [G, J]: the row of each lane
        that each of the window's global batches takes."""
        rows = self.window_batches_of(window)
        if not self.shuffle:
            return pieces, np.zeros((self.global_batch_size, rows), dtype=np.int64)
        rng = np.random.default_rng([self.seed, epoch, window])
        order = rng.permutation(len(pieces))
        sigma = rng.permuted(np.tile(np.arange(rows), (self.global_batch_size, 1)), axis=1)
        return [pieces[i] for i in order.tolist()], sigma

    def load(self, epoch: int, window: int, pieces: list[_Piece], lanes: np.ndarray) -> np.ndarray:
        """[len(lanes), J, seq_len]: the rows of ``lanes`` in the window, read chunk by chunk."""
        rows = self.window_batches_of(window)
        starts = np.cumsum([0] + [p.hi - p.lo for p in pieces])
        out = np.empty((len(lanes), rows, self.seq_len), dtype=self.dtype)
        wanted: dict[int, list[tuple[int, int, int]]] = {}  # piece -> (lane slot, from, to) in window order
        for slot, lane in enumerate(lanes.tolist()):
            first, stop = lane * rows, lane * rows + rows
            index = int(np.searchsorted(starts, first, side="right")) - 1
            while index < len(pieces) and starts[index] < stop:
                lo, hi = max(first, int(starts[index])), min(stop, int(starts[index + 1]))
                wanted.setdefault(index, []).append((slot, lo, hi))
                index += 1
        needed = sorted(wanted)
        for index, chunk in zip(needed, _read_all(self, epoch, [pieces[i] for i in needed])):
            base = int(starts[index]) - pieces[index].lo
            for slot, lo, hi in wanted[index]:
                first = lanes[slot] * rows
                out[slot, lo - first:hi - first] = chunk[lo - base:hi - base]
        return out

    def chunk_rows(self, epoch: int, piece: _Piece) -> "np.ndarray | _Permuted":
        """The rows of a piece's chunk in their permuted order (read and checked)."""
        shard = self.shards[piece.shard]
        info = shard.chunks[piece.chunk]
        chunk = decode_chunk(self.store.read(shard, info), self.store.name(shard))
        if chunk.shape != (info.rows, self.seq_len) or chunk.dtype.str != self.dtype:
            raise UserError(f"{self.store.name(shard)}: chunk of shape {chunk.shape} and dtype {chunk.dtype.str}, "
                            f"the manifest says [{info.rows}, {self.seq_len}] {self.dtype}; rerun `unmask prep`")
        if not self.shuffle:
            return chunk
        # The permuted order as a view's index: the rows are gathered once, into the lanes.
        return _Permuted(chunk, np.random.default_rng([self.seed, epoch, piece.shard, piece.chunk]).permutation(
            len(chunk)))

    def parts(self, epoch: int, first_global: int, part: int, parts: int) -> Iterator[torch.Tensor]:
        """This part's rows of global batches first_global, first_global + 1, ... of the epoch:
        ``LongTensor[len(part_lanes), seq_len]`` each, the next window read ahead in a thread."""
        lanes = self.part_lanes(part, parts)
        windows = self.windows(epoch)
        first_window, first_row = divmod(first_global, self.window_batches)
        todo = list(range(first_window, len(windows)))

        def prepare(window: int) -> tuple[np.ndarray, np.ndarray]:
            pieces, sigma = self.drawn(epoch, window, windows[window])
            return self.load(epoch, window, pieces, lanes), sigma[lanes]

        with ThreadPoolExecutor(max_workers=1) as ahead:
            pending: Future | None = ahead.submit(prepare, todo[0]) if todo else None
            for position, window in enumerate(todo):
                data, sigma = pending.result()
                pending = ahead.submit(prepare, todo[position + 1]) if position + 1 < len(todo) else None
                start = first_row if window == first_window else 0
                for row in range(start, self.window_batches_of(window)):
                    picked = data[np.arange(len(lanes)), sigma[:, row]]  # [lanes, seq_len]
                    yield torch.from_numpy(picked.astype(np.int64))


def _read_all(plan: _StreamPlan, epoch: int, pieces: list[_Piece]) -> Iterator["np.ndarray | _Permuted"]:
    """The permuted rows of each piece's chunk in order, READ_THREADS reads in flight."""
    with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
        futures: list[Future] = []
        for index, piece in enumerate(pieces):
            futures.append(pool.submit(plan.chunk_rows, epoch, piece))
            if len(futures) > READ_THREADS:
                yield futures.pop(0).result()
        for future in futures:
            yield future.result()


def _usable_rows(shards: list[ShardInfo], counts: list[int]) -> tuple[np.ndarray, ...]:
    """Per shard, the rows of each chunk that the stream uses: ``counts[i]`` rows in all."""
    usable = []
    for shard, count in zip(shards, counts):
        rows = np.array([chunk.rows for chunk in shard.chunks], dtype=np.int64)
        cut = np.minimum(rows, np.maximum(count - (np.cumsum(rows) - rows), 0))
        usable.append(cut)
    return tuple(usable)


@dataclass(frozen=True)
class _Permuted:
    """A chunk's rows in a permuted order, gathered only when sliced."""

    rows: np.ndarray    # [n, seq_len] as stored
    order: np.ndarray   # [n]: row i of the permuted chunk is rows[order[i]]

    def __getitem__(self, span: slice) -> np.ndarray:
        return self.rows[self.order[span]]


@dataclass(frozen=True)
class _WorkerFailure:
    """A user's mistake met in a DataLoader worker (a corrupt shard), or a read it stopped at
    a stop request (``common.stop_request``), sent to the main process as an item of the
    stream: raised there as itself, the one line it is. Raised in the worker, DataLoader would
    re-raise it with the worker's traceback folded into its message."""

    error: UserError | StopRequested


class _EpochStream(IterableDataset):
    def __init__(self, plan: _StreamPlan, epoch: int, first_global: int) -> None:
        self.plan, self.epoch, self.first_global = plan, epoch, first_global

    def __iter__(self) -> Iterator[torch.Tensor | _WorkerFailure]:
        info = get_worker_info()
        if info is None:
            return self.plan.parts(self.epoch, self.first_global, 0, 1)
        return self.in_worker(info.id, info.num_workers)

    def in_worker(self, part: int, parts: int) -> Iterator[torch.Tensor | _WorkerFailure]:
        try:
            yield from self.plan.parts(self.epoch, self.first_global, part, parts)
        except (UserError, StopRequested) as err:
            yield _WorkerFailure(err)


class StreamingLoader:
    """Iterate a split in batches; one ``for`` loop over the loader is one epoch (or the
    rest of it, after ``load_state_dict``). ``data`` is a data directory or a filesystem URI
    (``s3://bucket/prefix``). ``global_batch_size`` (default: ``batch_size`` x ``world_size``,
    no accumulation) must be a multiple of ``batch_size`` x ``world_size``. ``cache``
    keeps the chunks read from a remote store on local disk."""

    def __init__(self, data: str | Path, split: str, batch_size: int, *, rank: int = 0,
                 world_size: int = 1, global_batch_size: int | None = None, seed: int = 0, shuffle: bool = True,
                 shuffle_window: int = DEFAULT_SHUFFLE_WINDOW, num_workers: int = 0, pin_memory: bool = False,
                 drop_padded_tail: bool = True, cache: ChunkCache | None = None) -> None:
        manifest = read_manifest(data)
        if split not in manifest.splits:
            raise UserError(f"split {split!r} not in {data}; it has {sorted(manifest.splits)}")
        global_batch_size = global_batch_size or batch_size * world_size
        if (batch_size < 1 or not 0 <= rank < world_size or num_workers < 0 or shuffle_window < 1
                or global_batch_size % (batch_size * world_size)):
            raise UserError(f"bad loader arguments: batch_size={batch_size}, rank={rank}, world_size={world_size}, "
                            f"global_batch_size={global_batch_size}, num_workers={num_workers}, "
                            f"shuffle_window={shuffle_window}")
        info = manifest.splits[split]
        counts = [shard.sequences for shard in info.shards]
        if drop_padded_tail and info.padding_tokens and counts:
            counts[-1] -= 1
        global_batches = sum(counts) // global_batch_size
        if global_batches == 0:
            raise UserError(f"{data} split {split!r} has {sum(counts)} sequences: too few for a global batch "
                            f"of {global_batch_size} ({world_size} rank(s) x batch {batch_size} x "
                            f"{global_batch_size // (batch_size * world_size)} micro-batches)")
        window_batches = min(global_batches, max(1, shuffle_window // global_batch_size)) if shuffle else 1
        self.plan = _StreamPlan(ShardStore(data, cache), tuple(info.shards), _usable_rows(info.shards, counts),
                          manifest.seq_len, manifest.dtype, batch_size, rank, world_size, global_batch_size,
                          global_batches, window_batches, seed, shuffle)
        self.shuffle_window = shuffle_window
        self.data_sha256 = manifest.sha256()
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.epoch, self.batches = 0, 0

    def __len__(self) -> int:
        """Batches per epoch on every rank."""
        return self.plan.batches_per_epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        plan = self.plan
        first_global, skip = divmod(self.batches, plan.micro_batches)
        parts = max(1, self.num_workers)
        stream = _EpochStream(plan, self.epoch, first_global)
        extra = dict(prefetch_factor=PREFETCH_PARTS) if self.num_workers else {}
        items = iter(DataLoader(stream, batch_size=None, num_workers=self.num_workers, **extra))
        for _ in range(first_global, plan.global_batches):
            joined = []
            for _ in range(parts):  # the workers' parts of one global batch, in order (DataLoader's round robin)
                item = next(items)
                if isinstance(item, _WorkerFailure):
                    del items  # the workers stop now, not when a garbage collection finds the error's frame
                    raise item.error
                joined.append(item)
            rows = joined[0] if parts == 1 else torch.cat(joined)  # [micro_batches x batch_size, seq_len]
            for micro in range(skip, plan.micro_batches):
                batch = rows[micro * plan.batch_size:(micro + 1) * plan.batch_size]
                self.batches += 1
                yield batch.pin_memory() if self.pin_memory else batch
            skip = 0
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
                "shuffle_window": self.shuffle_window, "order": ORDER_VERSION,
                "data_sha256": self.data_sha256, "batch_size": plan.batch_size, "world_size": plan.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (of this or another number of ranks, see the module docstring)."""
        plan, mine = self.plan, self.state_dict()
        if state.get("order") != ORDER_VERSION:
            raise UserError(f"cannot resume the data loader: its position refers to another order of the data "
                            f"(order {state.get('order')!r}; this unmask resumes order {ORDER_VERSION}); train again "
                            f"in a new --run-dir")
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
