"""The loader at cluster scale: mixing, bytes read per rank, throughput from disk and from S3
(prints JSON lines; figures go in BENCHMARKS.md).

Cases (``--case``, default all):
- ``mixing``: PTB train + tinyshakespeare from ../shared/data, prepped together (GPT-2 BPE,
  seq 256, no val split: the stream holds the files' documents in input order), global
  batches of 64 with seed 0 and 1. Each sequence's source is told by its text (PTB is
  lowercased, with ``N`` for numbers; Shakespeare has capitals). Reports the share of
  global batches that are 100% one source, the dispersion of the per-batch Shakespeare
  count against a binomial with the corpus share (1.0: binomial; the issue's target is
  "consistent with", i.e. not far above 1), and the same with ``shuffle_window`` = one global
  batch, which makes a global batch one stretch of the stream as the loader before did.
- ``reads``: a synthetic split of one default window (2^18 sequences of 1024 tokens, 1 MiB
  chunks, 512 MiB), global batch 512 and 448, micro-batch G / W: bytes each simulated rank
  reads in an epoch for W = 1, 8, 64 (for 64, a sample of ranks), against split / W (target
  <= 1.25 plus the window's overhead: two chunks per stretch of a rank's lanes per window).
- ``throughput``: tokens/s one process gets (rank 0 of 1, micro-batch 8), from the page-cached
  local shards, and from a local S3 server (moto_server, a subprocess on 127.0.0.1) with the
  chunk cache cold, then warm, on a 64 MiB split.

    python bench/data_at_scale.py [--case mixing|reads|throughput]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_prep.shards.format import chunk_rows  # noqa: E402
from data_prep.shards.loader import StreamingLoader  # noqa: E402
from data_prep.shards.storage import READ_STATS, ChunkCache  # noqa: E402
from data_prep.tokenizer.gpt2_bpe import GPT2BPETokenizer  # noqa: E402
from data_prep.write_shards import PrepConfig, write_shards  # noqa: E402
from tests.support.mlflow_server import free_port  # noqa: E402
from tests.support.s3_server import CREDENTIALS  # noqa: E402
from tests.support.shard_fixtures import write_numbered_split  # noqa: E402

SHARED_DATA = REPO.parent / "shared" / "data"
PTB_TRAIN = SHARED_DATA / "ptb" / "ptb.train.txt"
SHAKESPEARE = SHARED_DATA / "corpora" / "tinyshakespeare" / "input.txt"
GPT2_DIR = SHARED_DATA / "gpt2-bpe"
MIX_SEQ_LEN, MIX_BATCH = 256, 64
# Capitals besides PTB's "N" (its token for numbers) in a sequence: Shakespeare's.
SHAKESPEARE_CAPITALS = 3
READ_SEQ_LEN, READ_SEQUENCES = 1024, 1 << 18
# 512: lanes of 512 rows, a chunk each; 448 (= 64 x 7): lanes of 585 rows, across chunk edges.
READ_GLOBAL_BATCHES = (512, 448)
SAMPLED_RANKS = 4
THROUGHPUT_SEQUENCES, THROUGHPUT_BATCH = 1 << 15, 8


def _sources(loader: StreamingLoader, tokenizer: GPT2BPETokenizer) -> list[list[bool]]:
    """Per global batch, whether each sequence is Shakespeare's."""
    def is_shakespeare(row) -> bool:
        text = tokenizer.decode(row.tolist())
        return sum(c.isupper() and c != "N" for c in text) >= SHAKESPEARE_CAPITALS

    return [[is_shakespeare(row) for row in batch] for batch in loader]


def bench_mixing(tmp: Path) -> None:
    tokenizer = GPT2BPETokenizer.from_directory(GPT2_DIR)
    out = tmp / "mix"
    config = PrepConfig(inputs=(str(PTB_TRAIN), str(SHAKESPEARE)), seq_len=MIX_SEQ_LEN, val_fraction=0.0)
    write_shards(config, tokenizer, out, workers=1, progress=False)
    for seed in (0, 1):
        for label, window in (("stretch (window = 1 global batch)", MIX_BATCH), ("default window", 1 << 18)):
            batches = _sources(StreamingLoader(out, "train", MIX_BATCH, seed=seed, shuffle_window=window), tokenizer)
            counts = np.array([sum(b) for b in batches])
            share = counts.sum() / (len(counts) * MIX_BATCH)
            dispersion = ((counts - MIX_BATCH * share) ** 2).sum() / (MIX_BATCH * share * (1 - share))
            first = counts[:30] / MIX_BATCH
            print(json.dumps({"bench": "mixing", "order": label, "seed": seed, "global_batches": len(counts),
                              "shakespeare_share": round(float(share), 4),
                              "batches_all_one_source": round(float(np.mean((counts == 0) | (counts == MIX_BATCH))), 4),
                              "dispersion_over_binomial": round(float(dispersion / (len(counts) - 1)), 3),
                              "first_30_share_min_max": [round(float(first.min()), 3), round(float(first.max()), 3)]}))


def _synthetic(directory: Path, sequences: int, seq_len: int) -> None:
    rows = chunk_rows(seq_len, np.dtype("<u2"))
    shard = rows * 16  # 16 MiB shards
    sizes = [shard] * (sequences // shard) + ([sequences % shard] if sequences % shard else [])
    write_numbered_split(directory, sizes, seq_len=seq_len, rows_per_chunk=rows)


def bench_reads(tmp: Path) -> None:
    data = tmp / "reads"
    _synthetic(data, READ_SEQUENCES, READ_SEQ_LEN)
    manifest = json.loads((data / "manifest.json").read_text())
    chunks = [c for s in manifest["splits"]["train"]["shards"] for c in s["chunks"]]
    split_bytes = sum(c["bytes"] for c in chunks)
    for global_batch, world in itertools.product(READ_GLOBAL_BATCHES, (1, 8, 64)):
        ranks = range(world) if world <= 8 else np.linspace(0, world - 1, SAMPLED_RANKS).astype(int).tolist()
        per_rank = []
        for rank in ranks:
            loader = StreamingLoader(data, "train", global_batch // world, rank=rank, world_size=world, seed=0,
                                     global_batch_size=global_batch)
            READ_STATS.reset()
            for _ in loader:
                pass
            per_rank.append(READ_STATS.bytes_read)
        print(json.dumps({"bench": "reads", "global_batch": global_batch, "world_size": world,
                          "ranks_measured": len(per_rank),
                          "split_mib": round(split_bytes / 2**20, 1), "chunk_mib": round(chunks[0]["bytes"] / 2**20, 3),
                          "max_rank_mib": round(max(per_rank) / 2**20, 2),
                          "max_rank_over_share": round(max(per_rank) / (split_bytes / world), 3)}))


def _rate(loader: StreamingLoader) -> float:
    start, tokens = time.perf_counter(), 0
    for batch in loader:
        tokens += batch.numel()
    return tokens / (time.perf_counter() - start)


def bench_throughput(tmp: Path) -> None:
    data = tmp / "throughput"
    _synthetic(data, THROUGHPUT_SEQUENCES, READ_SEQ_LEN)
    _rate(StreamingLoader(data, "train", THROUGHPUT_BATCH, seed=0))  # into the page cache
    local = [_rate(StreamingLoader(data, "train", THROUGHPUT_BATCH, seed=s)) for s in (1, 2)]
    print(json.dumps({"bench": "throughput", "source": "local disk (page cache)", "tokens_per_s": round(max(local))}))
    port = free_port()
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    os.environ.update(env)
    server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import pyarrow.fs as pafs

        for _ in range(600):
            try:
                filesystem = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], allow_bucket_creation=True)
                filesystem.create_dir("bench")
                break
            except OSError:
                time.sleep(0.1)
        for path in sorted(p for p in data.rglob("*") if p.is_file()):
            with filesystem.open_output_stream(f"bench/data/{path.relative_to(data).as_posix()}") as out:
                out.write(path.read_bytes())
        cache = tmp / "cache"
        for label in ("S3, cache cold", "S3, cache warm"):
            loader = StreamingLoader("s3://bench/data", "train", THROUGHPUT_BATCH, seed=1,
                                     cache=ChunkCache(cache, 1 << 40))
            print(json.dumps({"bench": "throughput", "source": label, "tokens_per_s": round(_rate(loader))}))
        no_cache = StreamingLoader("s3://bench/data", "train", THROUGHPUT_BATCH, seed=1)
        print(json.dumps({"bench": "throughput", "source": "S3, no cache", "tokens_per_s": round(_rate(no_cache))}))
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["mixing", "reads", "throughput"])
    args = parser.parse_args()
    print(json.dumps({"machine": platform.machine(), "python": platform.python_version(), "cpus": os.cpu_count()}))
    cases = {"mixing": bench_mixing, "reads": bench_reads, "throughput": bench_throughput}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in cases.items():
            if args.case in (None, name):
                case(Path(tmp))


if __name__ == "__main__":
    main()
