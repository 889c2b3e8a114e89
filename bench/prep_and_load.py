"""Data preparation and loading throughput (prints JSON lines; figures go in BENCHMARKS.md).

- prep: tokens/s of the tokenize stage of ``unmask prep`` with 1 and 2 Ray workers, next to
  the raw single-core sentencepiece encode rate of the same text, measured right before and
  after each prep (targets: each worker >= 80% of raw, 2 workers >= 1.6x of 1).
- ceiling: two plain processes encoding without Ray against one (what the machine allows).
- loader: tokens/s that ``StreamingLoader`` delivers in one process (target >= 20M), and
  the cost of its shard checksums: one epoch with them checked (the first read of each
  shard in a process) against the same epoch unchecked, each from a page-cached shard.
- overhead: shard bytes over raw token bytes (target < 2%).

The corpus is tinyshakespeare and PTB train from ../shared/data (6.2 MB), repeated to about
``--corpus-mb`` (at least one copy per file) and written as several files so that the
workers share the units. Each worker count pays a fixed start-up (Ray's actors import Ray
Data and load the tokenizer): a corpus of a few hundred MB makes it small next to the
tokenizing, as it is on a real corpus.

    python bench/prep_and_load.py [--corpus-mb 200] [--vocab-size 8192] [--seq-len 1024]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from data_prep import loader as loader_module
from data_prep.loader import StreamingLoader
from data_prep.prep import PrepConfig, prep
from data_prep.readers import ReadCounters, ReadOptions, plan_units, read_unit, resolve_inputs
from data_prep.tokenizer import load_tokenizer, train_sentencepiece

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SOURCES = [SHARED_DATA / "corpora" / "tinyshakespeare" / "input.txt", SHARED_DATA / "ptb" / "ptb.train.txt"]
CORPUS_FILES = 8          # enough units for two workers to share evenly
ENCODE_BATCH = 256        # documents per raw encode call, as the prep actors do
LOADER_BATCH = 32
RAW_SAMPLE_FILES = 2      # files per raw-rate sample (a quarter of the corpus)


def build_corpus(directory: Path, megabytes: int) -> list[str]:
    text = "\n\n".join(path.read_text() for path in SOURCES)
    per_file = max(1, round(megabytes * (1 << 20) / CORPUS_FILES / len(text.encode())))
    paths = []
    for index in range(CORPUS_FILES):
        path = directory / f"corpus-{index:02d}.txt"
        path.write_text("\n\n".join([text] * per_file))
        paths.append(str(path))
    return paths


def _documents(paths: list[str]) -> list[str]:
    options = ReadOptions()
    return [piece.text for unit in plan_units(resolve_inputs(paths), options)
            for piece in read_unit(unit, options, ReadCounters())]


def _timed_encode(paths: list[str], tokenizer_dir: str) -> tuple[int, float]:
    """Tokens and seconds of sentencepiece on one core over the documents of ``paths``."""
    processor = load_tokenizer(tokenizer_dir).processor
    documents = _documents(paths)
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(documents), ENCODE_BATCH):
        tokens += sum(map(len, processor.encode(documents[i:i + ENCODE_BATCH], num_threads=1)))
    return tokens, time.perf_counter() - start


def raw_encode_rate(paths: list[str], tokenizer_dir: str) -> float:
    """Tokens/s of sentencepiece on one core over the same documents."""
    tokens, seconds = _timed_encode(paths, tokenizer_dir)
    return tokens / seconds


def plain_processes_rate(paths: list[str], tokenizer_dir: str, processes: int) -> float:
    """Tokens/s of ``processes`` plain Python processes (no Ray), each encoding its share of
    the files, start-up excluded: what this machine allows that many workers at best."""
    shares = [(paths[i::processes], tokenizer_dir) for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        results = pool.starmap(_timed_encode, shares)
    return sum(tokens for tokens, _ in results) / max(seconds for _, seconds in results)


def loader_rate(data_dir: Path, epochs: int = 3, verify: bool = True) -> tuple[float, int]:
    """Tokens/s over ``epochs`` epochs; the checksums (``verify``) are checked in the first."""
    loader_module._VERIFIED.clear()
    loader = StreamingLoader(data_dir, "train", LOADER_BATCH, seed=0, verify=verify)
    start, tokens = time.perf_counter(), 0
    for _ in range(epochs):
        for batch in loader:
            tokens += batch.numel()
    return tokens / (time.perf_counter() - start), tokens


def bench_verification(data_dir: Path, rounds: int = 3) -> None:
    """One epoch that checks every shard's sha256 against the same epoch without, alternated."""
    loader_rate(data_dir, epochs=1, verify=False)  # the shards into the page cache
    checked, unchecked = [], []
    for _ in range(rounds):
        checked.append(loader_rate(data_dir, epochs=1, verify=True)[0])
        unchecked.append(loader_rate(data_dir, epochs=1, verify=False)[0])
    best_checked, best_unchecked = max(checked), max(unchecked)
    print(json.dumps({"bench": "loader_checksums", "first_epoch_checked_tokens_per_s": round(best_checked),
                      "first_epoch_unchecked_tokens_per_s": round(best_unchecked),
                      "checked_vs_unchecked": round(best_checked / best_unchecked, 3)}))


def _raw_near(paths: list[str], tokenizer_dir: str) -> float:
    """The raw rate on the first files: cheap enough to take right next to each measurement,
    since this kind of VM drifts by 10-20% over minutes."""
    return raw_encode_rate(paths[:RAW_SAMPLE_FILES], tokenizer_dir)


def bench_prep(paths: list[str], tokenizer_dir: str, workers: int, out: Path, seq_len: int) -> float:
    """One prep with ``workers`` actors, between two raw measurements; its tokens/s."""
    raw_before = _raw_near(paths, tokenizer_dir)
    result = prep(PrepConfig(inputs=tuple(paths), seq_len=seq_len), load_tokenizer(tokenizer_dir), out,
                  workers=workers, progress=False)
    raw = (raw_before + _raw_near(paths, tokenizer_dir)) / 2
    rate = result.tokens_run / result.tokenize_seconds
    busy_rate = result.tokens_run / result.worker_seconds
    print(json.dumps({"bench": "prep", "workers": workers, "tokens": result.tokens_run,
                      "tokenize_seconds": round(result.tokenize_seconds, 2), "total_seconds": round(result.seconds, 2),
                      "tokens_per_s": round(rate), "raw_tokens_per_s": round(raw),
                      "per_worker_vs_raw": round(rate / workers / raw, 3),
                      "busy_tokens_per_s_per_worker": round(busy_rate), "busy_vs_raw": round(busy_rate / raw, 3),
                      # start-up and scheduling: the stage's time not spent tokenizing
                      "not_busy_seconds": round(result.tokenize_seconds - result.worker_seconds / workers, 2)}))
    return rate


def bench_ceiling(paths: list[str], tokenizer_dir: str) -> None:
    """Two plain processes against one, on the same files, back to back."""
    sample = paths[:2 * RAW_SAMPLE_FILES]
    one = raw_encode_rate(sample, tokenizer_dir)
    two = plain_processes_rate(sample, tokenizer_dir, 2)
    print(json.dumps({"bench": "raw_encode_processes", "one_tokens_per_s": round(one),
                      "two_tokens_per_s": round(two), "two_vs_one": round(two / one, 3)}))


def bench_loader_and_overhead(out: Path, vocab_size: int, seq_len: int) -> None:
    rate, tokens = loader_rate(out)
    print(json.dumps({"bench": "loader", "batch": LOADER_BATCH, "seq_len": seq_len,
                      "tokens": tokens, "tokens_per_s": round(rate)}))
    bench_verification(out)
    manifest_splits = json.loads((out / "manifest.json").read_text())["splits"]
    itemsize = np.dtype("<u2").itemsize if vocab_size <= 1 << 16 else 4
    shard_bytes = sum(s["bytes"] for split in manifest_splits.values() for s in split["shards"])
    token_bytes = sum(split["sequences"] for split in manifest_splits.values()) * seq_len * itemsize
    print(json.dumps({"bench": "shard_overhead", "shard_bytes": shard_bytes, "token_bytes": token_bytes,
                      "overhead": round(shard_bytes / token_bytes - 1, 5)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-mb", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--loader-only", action="store_true",
                        help="one 1-worker prep, then only the loader measurements")
    args = parser.parse_args()
    print(json.dumps({"machine": platform.machine(), "python": platform.python_version()}))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = build_corpus(tmp, args.corpus_mb)
        tokenizer_dir = str(tmp / "tok")
        train_sentencepiece((Path(p).read_text() for p in paths[:1]), tokenizer_dir, args.vocab_size)
        print(json.dumps({"bench": "corpus", "bytes": sum(Path(p).stat().st_size for p in paths)}))
        if args.loader_only:
            prep(PrepConfig(inputs=tuple(paths), seq_len=args.seq_len), load_tokenizer(tokenizer_dir),
                 tmp / "out-1", workers=1, progress=False)
        else:
            bench_ceiling(paths, tokenizer_dir)
            rates = {w: bench_prep(paths, tokenizer_dir, w, tmp / f"out-{w}", args.seq_len) for w in (1, 2)}
            print(json.dumps({"bench": "prep_scaling", "two_vs_one": round(rates[2] / rates[1], 3)}))
        bench_loader_and_overhead(tmp / "out-1", args.vocab_size, args.seq_len)


if __name__ == "__main__":
    main()
