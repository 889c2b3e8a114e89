"""Data preparation and loading throughput (prints JSON lines; figures go in BENCHMARKS.md).

- prep: tokens/s of the tokenize stage of ``unmask prep`` with 1 and 2 Ray workers, next to
  the raw single-core sentencepiece encode rate of the same documents, measured in the same
  run (targets: each worker >= 80% of raw, 2 workers >= 1.6x of 1).
- loader: tokens/s that ``StreamingLoader`` delivers in one process (target >= 20M).
- overhead: shard bytes over raw token bytes (target < 2%).

The corpus is tinyshakespeare and PTB train from ../shared/data, repeated to ``--corpus-mb``
and written as several files so that the workers share the units.

    python bench/prep_and_load.py [--corpus-mb 40] [--vocab-size 8192] [--seq-len 1024]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from data_prep.loader import StreamingLoader
from data_prep.prep import PrepConfig, prep
from data_prep.readers import ReadCounters, ReadOptions, plan_units, read_unit, resolve_inputs
from data_prep.tokenizer import train_sentencepiece

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SOURCES = [SHARED_DATA / "corpora" / "tinyshakespeare" / "input.txt", SHARED_DATA / "ptb" / "ptb.train.txt"]
CORPUS_FILES = 8          # enough units for two workers to share evenly
ENCODE_BATCH = 256        # documents per raw encode call, as the prep actors do
LOADER_BATCH = 32


def build_corpus(directory: Path, megabytes: int) -> list[str]:
    text = "\n\n".join(path.read_text() for path in SOURCES)
    copies = max(1, megabytes * (1 << 20) // len(text.encode()))
    per_file = max(1, copies // CORPUS_FILES)
    paths = []
    for index in range(CORPUS_FILES):
        path = directory / f"corpus-{index:02d}.txt"
        path.write_text("\n\n".join([text] * per_file))
        paths.append(str(path))
    return paths


def raw_encode_rate(paths: list[str], tokenizer) -> float:
    """Tokens/s of sentencepiece on one core over the same documents."""
    options = ReadOptions()
    documents = [piece.text for unit in plan_units(resolve_inputs(paths), options)
                 for piece in read_unit(unit, options, ReadCounters())]
    processor = tokenizer.processor
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(documents), ENCODE_BATCH):
        tokens += sum(map(len, processor.encode(documents[i:i + ENCODE_BATCH], num_threads=1)))
    return tokens / (time.perf_counter() - start)


def loader_rate(data_dir: Path, epochs: int = 3) -> tuple[float, int]:
    loader = StreamingLoader(data_dir, "train", LOADER_BATCH, seed=0)
    start, tokens = time.perf_counter(), 0
    for _ in range(epochs):
        for batch in loader:
            tokens += batch.numel()
    return tokens / (time.perf_counter() - start), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-mb", type=int, default=40)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args()
    print(json.dumps({"machine": platform.machine(), "python": platform.python_version()}))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = build_corpus(tmp, args.corpus_mb)
        corpus_bytes = sum(Path(p).stat().st_size for p in paths)
        tokenizer = train_sentencepiece((Path(p).read_text() for p in paths[:1]), tmp / "tok", args.vocab_size)
        raw = raw_encode_rate(paths, tokenizer)
        print(json.dumps({"bench": "raw_encode", "corpus_bytes": corpus_bytes, "tokens_per_s": round(raw)}))
        rates = {}
        for workers in (1, 2):
            config = PrepConfig(inputs=tuple(paths), seq_len=args.seq_len)
            result = prep(config, tokenizer, tmp / f"out-{workers}", workers=workers, progress=False)
            rates[workers] = result.tokens_run / result.tokenize_seconds
            busy_rate = result.tokens_run / result.worker_seconds
            print(json.dumps({"bench": "prep", "workers": workers, "tokens": result.tokens_run,
                              "tokenize_seconds": round(result.tokenize_seconds, 2),
                              "total_seconds": round(result.seconds, 2), "tokens_per_s": round(rates[workers]),
                              "per_worker_vs_raw": round(rates[workers] / workers / raw, 3),
                              "busy_tokens_per_s_per_worker": round(busy_rate),
                              "busy_vs_raw": round(busy_rate / raw, 3)}))
        print(json.dumps({"bench": "prep_scaling", "two_vs_one": round(rates[2] / rates[1], 3)}))
        out = tmp / "out-1"
        rate, tokens = loader_rate(out)
        print(json.dumps({"bench": "loader", "batch": LOADER_BATCH, "seq_len": args.seq_len,
                          "tokens": tokens, "tokens_per_s": round(rate)}))
        manifest_splits = json.loads((out / "manifest.json").read_text())["splits"]
        itemsize = np.dtype("<u2").itemsize if args.vocab_size <= 1 << 16 else 4
        shard_bytes = sum(s["bytes"] for split in manifest_splits.values() for s in split["shards"])
        token_bytes = sum(split["sequences"] for split in manifest_splits.values()) * args.seq_len * itemsize
        print(json.dumps({"bench": "shard_overhead", "shard_bytes": shard_bytes, "token_bytes": token_bytes,
                          "overhead": round(shard_bytes / token_bytes - 1, 5)}))


if __name__ == "__main__":
    main()
