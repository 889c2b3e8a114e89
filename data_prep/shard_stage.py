"""Stage 2 of ``unmask prep``: the split token streams -> shards, each one independently.

Once every unit is tokenized, the token offset of each unit in its split's stream is known
(``SplitLayout``), so every shard (a fixed range of sequences) can be cut and written on its
own, in parallel, and recorded in the ledger.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from data_prep.ledger import Ledger
from data_prep.shards.format import ShardInfo, shard_path, write_shard

__all__ = ["SplitLayout", "plan_shards", "shard_key", "write_one_shard"]


@dataclass(frozen=True)
class SplitLayout:
    """Where each unit's tokens of one split start in the split's token stream."""

    split: str
    unit_indices: list[int]
    unit_offsets: list[int]      # cumulative, len(units) + 1
    seq_len: int
    pad_id: int

    @property
    def tokens(self) -> int:
        return self.unit_offsets[-1]

    @property
    def sequences(self) -> int:
        return math.ceil(self.tokens / self.seq_len)


def shard_key(split: str, index: int) -> str:
    return f"shard-{split}-{index:06d}"


def _read_token_range(layout: SplitLayout, work: Path, start: int, stop: int,
                      dtype: np.dtype) -> tuple[np.ndarray, int]:
    """Tokens [start, stop) of the split stream, and the UTF-8 bytes of the documents whose
    EOS lies in that range."""
    parts, text_bytes = [], 0
    for unit, lo, hi in zip(layout.unit_indices, layout.unit_offsets, layout.unit_offsets[1:]):
        if hi <= start or lo >= stop or hi == lo:
            continue
        prefix = work / "units" / f"{unit:06d}"
        tokens = np.memmap(prefix.with_name(f"{prefix.name}.{layout.split}.tokens"), dtype=dtype, mode="r")
        parts.append(np.asarray(tokens[max(start, lo) - lo:min(stop, hi) - lo]))
        docs = np.load(prefix.with_name(f"{prefix.name}.{layout.split}.docs.npy"))
        eos_at = lo + np.cumsum(docs[:, 0]) - 1
        text_bytes += int(docs[(eos_at >= start) & (eos_at < stop), 1].sum())
    return (np.concatenate(parts) if parts else np.empty(0, dtype)), text_bytes


def write_one_shard(row: dict, layouts: dict[str, SplitLayout], work: str, out: str,
                    dtype: np.dtype, rows_per_chunk: int) -> dict:
    """Ray Data task: cut sequences [first, first + count) of a split into a shard."""
    layout = layouts[row["split"]]
    try:
        info = _cut_shard(layout, row["index"], row["first"], row["count"], Path(work), Path(out), dtype,
                          rows_per_chunk)
    except OSError as err:  # e.g. a full disk: travels as data (see tokenize_stage.UnitTokenizer)
        return {**row, "error": f"writing {Path(out) / shard_path(layout.split, row['index'])}: {err}"}
    Ledger(Path(work) / "ledger").record(shard_key(layout.split, row["index"]), asdict(info))
    return {**row, "error": ""}


def _cut_shard(layout: SplitLayout, index: int, first: int, count: int, work: Path, out: Path,
               dtype: np.dtype, rows_per_chunk: int) -> ShardInfo:
    seq_len = layout.seq_len
    start, stop = first * seq_len, (first + count) * seq_len
    tokens, text_bytes = _read_token_range(layout, work, start, min(stop, layout.tokens), dtype)
    padding = stop - start - len(tokens)
    sequences = np.concatenate([tokens, np.full(padding, layout.pad_id, dtype)]).reshape(-1, seq_len)
    relative = shard_path(layout.split, index)
    written = write_shard(out / relative, sequences, index, rows_per_chunk)
    return ShardInfo(path=relative, sequences=count, tokens=len(tokens), utf8_bytes=text_bytes,
                     sha256=written.sha256, bytes=written.bytes, chunks=written.chunks)


def plan_shards(layout: SplitLayout, sequences_per_shard: int) -> list[dict]:
    return [{"split": layout.split, "index": index, "first": first,
             "count": min(sequences_per_shard, layout.sequences - first)}
            for index, first in enumerate(range(0, layout.sequences, sequences_per_shard))]
