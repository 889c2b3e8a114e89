"""Data preparation and loading throughput (prints JSON lines; figures go in BENCHMARKS.md).

Two cases (``--case``):

``sentencepiece`` (the default):
- prep: tokens/s of the tokenize stage of ``unmask prep`` with 1 worker (in one process) and
  2 Ray workers, next to the raw single-core sentencepiece encode rate of the same text,
  measured right before and after each prep (targets: each worker >= 80% of raw, 2 workers
  >= 1.6x of 1).
- ceiling: two plain processes encoding without Ray against one (what the machine allows).
- loader: tokens/s that ``StreamingLoader`` delivers in one process (target >= 20M), each
  chunk's sha256 checked as it is read.
- loader_rank: tokens/s that rank 0 of ``LOADER_WORLD`` ranks gets in one process, against
  the one-rank figure (a rank reads only its share: ``bench/data_at_scale.py``).
- overhead: shard bytes over raw token bytes (target < 2%).

The corpus is tinyshakespeare and PTB train from ../shared/data (6.2 MB), repeated to about
``--corpus-mb`` (at least one copy per file) and written as several files so that the
workers share the units. Ray workers pay a fixed start-up (Ray's actors import Ray Data and
load the tokenizer): a corpus of a few hundred MB makes it small next to the tokenizing, as
it is on a real corpus.

``gpt2-short-paragraphs``: GPT-2's BPE (tiktoken, from ../shared/data/gpt2-bpe) on many short
paragraphs, the case where the prep's per-document work weighs most next to the encoder:
every paragraph of tinyshakespeare and WikiText-2 raw, every passage of LAMBADA and every
sentence of PTB and 1BW, each a paragraph of its own, repeated to ``--corpus-mb``.
- encoders: tokens/s of tiktoken alone (raw: one call per document), of tiktoken with one
  call per batch of documents (joined by <|endoftext|>, as the prep now calls it), of our
  wrapper, and of the ``tokenizers`` BPE that the prep ran before (same ids), on one core.
- prep: end to end (the whole ``prep`` call) and the tokenize stage, with 1 and 2 workers,
  next to the raw tiktoken rate measured right before and after each prep (target: end to
  end >= 0.8x raw per worker). Both count text tokens: the prep's EOS, one per document,
  which the raw encoder does not make, are left out of its rate.
- startup: seconds of a one-worker ``unmask prep`` of a 2 KB file, as a user runs it (the
  command's import included), and of the ``prep`` call alone (target: < 5 s).

    python bench/prep_and_load.py [--case sentencepiece|gpt2-short-paragraphs] [--corpus-mb 200]
                                  [--vocab-size 8192] [--seq-len 1024]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/ holds the reference GPT-2 BPE

from data_prep.readers import ReadCounters, ReadOptions, plan_units, read_unit, resolve_inputs  # noqa: E402
from data_prep.shards.loader import StreamingLoader  # noqa: E402
from data_prep.tokenizer.gpt2_bpe import GPT2BPETokenizer  # noqa: E402
from data_prep.tokenizer.load import load_tokenizer  # noqa: E402
from data_prep.tokenizer.sentencepiece_model import SentencePieceTokenizer, train_sentencepiece  # noqa: E402
from data_prep.write_shards import PrepConfig, write_shards  # noqa: E402
from tests.support.tokenizer_fixtures import reference_gpt2  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SOURCES = [SHARED_DATA / "corpora" / "tinyshakespeare" / "input.txt", SHARED_DATA / "ptb" / "ptb.train.txt"]
GPT2_DIR = SHARED_DATA / "gpt2-bpe"
# Short paragraphs: (file, whether each of its lines is a paragraph, else it has blank lines between them).
PARAGRAPH_SOURCES = [
    (SHARED_DATA / "corpora" / "tinyshakespeare" / "input.txt", False),
    (SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw", True), (SHARED_DATA / "wikitext-2-raw" / "wiki.valid.raw", True),
    (SHARED_DATA / "lambada" / "lambada_test_plain_text.txt", True),
    (SHARED_DATA / "lambada" / "lambada_development_plain_text.txt", True),
    (SHARED_DATA / "lm1b" / "news.en.heldout-00000-of-00050", True),
    (SHARED_DATA / "ptb" / "ptb.train.txt", True), (SHARED_DATA / "ptb" / "ptb.valid.txt", True),
    (SHARED_DATA / "ptb" / "ptb.test.txt", True),
]
STARTUP_TEXT_BYTES = 2000
CORPUS_FILES = 8          # enough units for two workers to share evenly
ENCODE_BATCH = 256        # documents per raw encode call, as the prep actors do
LOADER_BATCH = 32
LOADER_WORLD = 8          # ranks of the per-rank loader figure
RAW_SAMPLE_FILES = 2      # files per raw-rate sample (a quarter of the corpus)


def build_corpus(directory: Path, megabytes: int, text: str | None = None) -> list[str]:
    """``text`` (default: the SOURCES joined as paragraphs) repeated into CORPUS_FILES files of
    about ``megabytes`` in all, at least one copy per file."""
    text = text if text is not None else "\n\n".join(path.read_text() for path in SOURCES)
    per_file = max(1, round(megabytes * (1 << 20) / CORPUS_FILES / len(text.encode())))
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(CORPUS_FILES):
        path = directory / f"corpus-{index:02d}.txt"
        path.write_text("\n\n".join([text] * per_file))
        paths.append(str(path))
    return paths


def short_paragraphs() -> str:
    """The PARAGRAPH_SOURCES, each paragraph, passage or sentence a paragraph of its own."""
    paragraphs = []
    for path, by_line in PARAGRAPH_SOURCES:
        text = path.read_text(encoding="utf-8")
        parts = text.splitlines() if by_line else text.split("\n\n")
        paragraphs += [part.strip("\n") for part in parts if part.strip()]
    return "\n\n".join(paragraphs)


def _documents(paths: list[str]) -> list[str]:
    options = ReadOptions()
    return [piece.text for unit in plan_units(resolve_inputs(paths), options)
            for piece in read_unit(unit, options, ReadCounters())]


def _raw_encoder(tokenizer_path: str) -> Callable[[list[str]], int]:
    """The library's own single-core encode, without our wrapper: tokens of a batch of documents."""
    tokenizer = load_tokenizer(tokenizer_path)
    if isinstance(tokenizer, GPT2BPETokenizer):
        encode = tokenizer.encoding.encode_ordinary
        return lambda batch: sum(len(encode(text)) for text in batch)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    processor = tokenizer.processor
    return lambda batch: sum(map(len, processor.encode(batch, num_threads=1)))


def _timed(encode: Callable[[list[str]], int], documents: list[str]) -> tuple[int, float]:
    """Tokens and seconds of ``encode`` over ``documents``, in batches as the prep actors take them."""
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(documents), ENCODE_BATCH):
        tokens += encode(documents[i:i + ENCODE_BATCH])
    return tokens, time.perf_counter() - start


def _timed_encode(paths: list[str], tokenizer_path: str) -> tuple[int, float]:
    """Tokens and seconds of the raw encoder on one core over the documents of ``paths``."""
    return _timed(_raw_encoder(tokenizer_path), _documents(paths))


def raw_encode_rate(paths: list[str], tokenizer_path: str) -> float:
    """Tokens/s of the raw encoder on one core over the same documents."""
    tokens, seconds = _timed_encode(paths, tokenizer_path)
    return tokens / seconds


def plain_processes_rate(paths: list[str], tokenizer_path: str, processes: int) -> float:
    """Tokens/s of ``processes`` plain Python processes (no Ray), each encoding its share of
    the files, start-up excluded: what this machine allows that many workers at best."""
    shares = [(paths[i::processes], tokenizer_path) for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        results = pool.starmap(_timed_encode, shares)
    return sum(tokens for tokens, _ in results) / max(seconds for _, seconds in results)


def loader_rate(data_dir: Path, epochs: int = 3, world_size: int = 1) -> tuple[float, int]:
    """Tokens/s that rank 0 of ``world_size`` gets over ``epochs`` epochs (each chunk's sha256
    is checked as it is read)."""
    loader = StreamingLoader(data_dir, "train", LOADER_BATCH, rank=0, world_size=world_size, seed=0)
    start, tokens = time.perf_counter(), 0
    for _ in range(epochs):
        for batch in loader:
            tokens += batch.numel()
    return tokens / (time.perf_counter() - start), tokens


def _raw_near(paths: list[str], tokenizer_path: str) -> float:
    """The raw rate on the first files: cheap enough to take right next to each measurement,
    since this kind of VM drifts by 10-20% over minutes."""
    return raw_encode_rate(paths[:RAW_SAMPLE_FILES], tokenizer_path)


def bench_prep(paths: list[str], tokenizer_path: str, workers: int, out: Path, seq_len: int,
               name: str = "prep") -> float:
    """One prep with ``workers`` workers, between two raw measurements; its tokens/s."""
    raw_before = _raw_near(paths, tokenizer_path)
    result = write_shards(PrepConfig(inputs=tuple(paths), seq_len=seq_len), load_tokenizer(tokenizer_path), out,
                          workers=workers, progress=False)
    raw = (raw_before + _raw_near(paths, tokenizer_path)) / 2
    documents = sum(split.documents for split in result.manifest.splits.values())
    text_tokens = result.tokens_run - documents  # as the raw encoder counts: no EOS
    rate = text_tokens / result.tokenize_seconds
    end_to_end = text_tokens / result.seconds
    busy_rate = text_tokens / result.worker_seconds
    print(json.dumps({"bench": name, "workers": workers, "text_tokens": text_tokens, "documents": documents,
                      "tokens_per_document": round(text_tokens / documents, 1),
                      "tokenize_seconds": round(result.tokenize_seconds, 2), "total_seconds": round(result.seconds, 2),
                      "tokens_per_s": round(rate), "raw_tokens_per_s": round(raw),
                      "per_worker_vs_raw": round(rate / workers / raw, 3),
                      "end_to_end_tokens_per_s": round(end_to_end),
                      "end_to_end_per_worker_vs_raw": round(end_to_end / workers / raw, 3),
                      "busy_tokens_per_s_per_worker": round(busy_rate), "busy_vs_raw": round(busy_rate / raw, 3),
                      # start-up and scheduling: the stage's time not spent tokenizing
                      "not_busy_seconds": round(result.tokenize_seconds - result.worker_seconds / workers, 2)}))
    return end_to_end


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
    rank_rate, rank_tokens = loader_rate(out, world_size=LOADER_WORLD)
    print(json.dumps({"bench": "loader_rank", "world_size": LOADER_WORLD, "batch": LOADER_BATCH,
                      "tokens": rank_tokens, "tokens_per_s": round(rank_rate), "vs_one_rank": round(rank_rate / rate, 3)}))
    manifest_splits = json.loads((out / "manifest.json").read_text())["splits"]
    itemsize = np.dtype("<u2").itemsize if vocab_size <= 1 << 16 else 4
    shard_bytes = sum(s["bytes"] for split in manifest_splits.values() for s in split["shards"])
    token_bytes = sum(split["sequences"] for split in manifest_splits.values()) * seq_len * itemsize
    print(json.dumps({"bench": "shard_overhead", "shard_bytes": shard_bytes, "token_bytes": token_bytes,
                      "overhead": round(shard_bytes / token_bytes - 1, 5)}))


def bench_gpt2_encoders(paths: list[str]) -> None:
    """tiktoken alone (a call per document, and a call per batch), our wrapper, and the
    reference BPE, on one core, over the same documents."""
    documents = _documents(paths[:RAW_SAMPLE_FILES])
    wrapper = load_tokenizer(GPT2_DIR)
    reference = reference_gpt2()

    def joined_raw(batch: list[str]) -> int:  # text tokens: the joins' EOS left out
        ids = wrapper.encoding.encode_to_numpy("<|endoftext|>".join(batch), allowed_special={"<|endoftext|>"},
                                               disallowed_special=())
        return len(ids) - (len(batch) - 1)

    encoders = {"raw_tiktoken": _raw_encoder(str(GPT2_DIR)),
                "raw_tiktoken_one_call_per_batch": joined_raw,
                "wrapper": lambda batch: sum(map(len, wrapper.encode_batch(batch))),
                "reference_tokenizers_bpe": lambda batch: sum(len(e.ids) for e in reference.encode_batch_fast(batch))}
    rates = {}
    for name, encode in encoders.items():
        tokens, seconds = _timed(encode, documents)
        rates[name] = tokens / seconds
    print(json.dumps({"bench": "gpt2_encoders", "documents": len(documents),
                      **{f"{name}_tokens_per_s": round(rate) for name, rate in rates.items()},
                      "wrapper_vs_raw": round(rates["wrapper"] / rates["raw_tiktoken"], 3),
                      "one_call_per_batch_vs_raw": round(rates["raw_tiktoken_one_call_per_batch"]
                                                         / rates["raw_tiktoken"], 3),
                      "raw_vs_reference": round(rates["raw_tiktoken"] / rates["reference_tokenizers_bpe"], 2)}))


def bench_startup(directory: Path, seq_len: int) -> None:
    """A one-worker prep of a tiny file: the `unmask prep` command as a user runs it, and the
    ``prep`` call alone (tokenizer loaded)."""
    directory.mkdir(parents=True, exist_ok=True)
    tiny = directory / "tiny.txt"
    tiny.write_text(short_paragraphs()[:STARTUP_TEXT_BYTES])
    unmask = Path(sys.executable).parent / "unmask"
    started = time.perf_counter()
    subprocess.run([str(unmask), "prep", "--input", str(tiny), "--out", str(directory / "cli"), "--seq-len",
                    str(seq_len), "--tokenizer", str(GPT2_DIR), "--no-progress"], check=True, capture_output=True)
    command = time.perf_counter() - started
    tokenizer = load_tokenizer(GPT2_DIR)
    result = write_shards(PrepConfig(inputs=(str(tiny),), seq_len=seq_len), tokenizer, directory / "call",
                          progress=False)
    print(json.dumps({"bench": "prep_startup", "workers": 1, "command_seconds": round(command, 2),
                      "prep_call_seconds": round(result.seconds, 3)}))


def run_gpt2_short_paragraphs(tmp: Path, corpus_mb: int, seq_len: int) -> None:
    text = short_paragraphs()
    per_file = corpus_mb * (1 << 20) // CORPUS_FILES
    if per_file < len(text):  # a quick run: less than one copy of the paragraphs per file
        text = text[:text.rindex("\n\n", 0, per_file)]
    paths = build_corpus(tmp / "paragraphs", corpus_mb, text)
    print(json.dumps({"bench": "corpus", "case": "gpt2-short-paragraphs",
                      "bytes": sum(Path(p).stat().st_size for p in paths)}))
    bench_startup(tmp / "startup", seq_len)
    bench_gpt2_encoders(paths)
    rates = {w: bench_prep(paths, str(GPT2_DIR), w, tmp / f"gpt2-{w}", seq_len, "prep_gpt2_short_paragraphs")
             for w in (1, 2)}
    print(json.dumps({"bench": "prep_gpt2_scaling", "two_vs_one": round(rates[2] / rates[1], 3)}))


def run_sentencepiece(tmp: Path, args: argparse.Namespace) -> None:
    paths = build_corpus(tmp / "corpus", args.corpus_mb)
    tokenizer_dir = str(tmp / "tok")
    train_sentencepiece((Path(p).read_text() for p in paths[:1]), tokenizer_dir, args.vocab_size)
    print(json.dumps({"bench": "corpus", "case": "sentencepiece", "bytes": sum(Path(p).stat().st_size for p in paths)}))
    if args.loader_only:
        write_shards(PrepConfig(inputs=tuple(paths), seq_len=args.seq_len), load_tokenizer(tokenizer_dir),
                     tmp / "out-1", workers=1, progress=False)
    else:
        bench_ceiling(paths, tokenizer_dir)
        rates = {w: bench_prep(paths, tokenizer_dir, w, tmp / f"out-{w}", args.seq_len) for w in (1, 2)}
        print(json.dumps({"bench": "prep_scaling", "two_vs_one": round(rates[2] / rates[1], 3)}))
    bench_loader_and_overhead(tmp / "out-1", args.vocab_size, args.seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["sentencepiece", "gpt2-short-paragraphs"], default="sentencepiece")
    parser.add_argument("--corpus-mb", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=8192, help="of the sentencepiece case's tokenizer")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--loader-only", action="store_true",
                        help="sentencepiece case: one 1-worker prep, then only the loader measurements")
    args = parser.parse_args()
    print(json.dumps({"machine": platform.machine(), "python": platform.python_version()}))
    with tempfile.TemporaryDirectory() as tmp:
        if args.case == "gpt2-short-paragraphs":
            run_gpt2_short_paragraphs(Path(tmp), args.corpus_mb, args.seq_len)
        else:
            run_sentencepiece(Path(tmp), args)


if __name__ == "__main__":
    main()
