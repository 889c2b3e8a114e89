"""Synthetic shards for loader and format tests (sequence i is filled with the value i), and
a byte-level view of a prep's output for comparing two preps."""

from pathlib import Path

import numpy as np

from data_prep.shards.format import FORMAT_VERSION, Manifest, ShardInfo, SplitInfo, shard_path, write_shard


def write_numbered_split(data_dir: Path, shard_sizes: list[int], seq_len: int = 8, rows_per_chunk: int = 3,
                         padding_tokens: int = 0, split: str = "train") -> Manifest:
    """Shards whose sequence number k (over the split) holds k in every position (k mod 2^16,
    for the benches' large splits)."""
    infos, first = [], 0
    for index, size in enumerate(shard_sizes):
        sequences = np.repeat((np.arange(first, first + size) % 65536).astype("<u2")[:, None], seq_len, axis=1)
        written = write_shard(data_dir / shard_path(split, index), sequences, index, rows_per_chunk)
        infos.append(ShardInfo(path=shard_path(split, index), sequences=size, tokens=size * seq_len,
                               utf8_bytes=0, sha256=written.sha256, bytes=written.bytes, chunks=written.chunks))
        first += size
    total = sum(shard_sizes)
    manifest = Manifest(
        format_version=FORMAT_VERSION, tokenizer={"kind": "synthetic", "vocab_size": 65536}, seq_len=seq_len,
        dtype="<u2", chunk_rows=rows_per_chunk, pad_id=0, prep_config={}, prep_config_sha256="0" * 64,
        inputs=[], counts={}, splits={split: SplitInfo(documents=total, tokens=total * seq_len - padding_tokens,
                                                       sequences=total, padding_tokens=padding_tokens, shards=infos)})
    manifest.write(data_dir)
    return manifest


def tree_bytes(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by relative path: equal trees are byte-identical outputs."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
