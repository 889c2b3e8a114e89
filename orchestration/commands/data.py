"""The ``unmask tokenizer train`` and ``unmask prep`` commands."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

from common.atomic_files import atomic_write_bytes
from common.errors import UserError, output_dir
from data_prep.prep import DEFAULT_SHARD_BYTES, DEFAULT_VAL_FRACTION, PrepConfig, prep
from data_prep.readers import (
    DEFAULT_UNIT_BYTES,
    ReadCounters,
    ReadOptions,
    binary_reason,
    plan_units,
    read_unit,
    resolve_inputs,
)
from data_prep.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece

TOKENIZER_SUBDIR = "tokenizer"
# Written next to a tokenizer that `unmask prep --vocab-size` trained, to reuse it on rerun.
TRAINING_REQUEST_NAME = "training_request.json"
RAW = argparse.RawDescriptionHelpFormatter

TOKENIZER_EPILOG = """\
example:
  unmask tokenizer train --input corpus/ --vocab-size 32000 --out tok/
"""

PREP_EPILOG = """\
examples:
  unmask prep --input data/owt/*.jsonl.gz --out shards/ --seq-len 1024 \\
      --tokenizer ../shared/data/gpt2-bpe --workers 8
  unmask prep --input input.txt --out shards/ --seq-len 256 --vocab-size 4096
  unmask prep --input s3://bucket/corpus/ --text-column content --out shards/ \\
      --seq-len 1024 --tokenizer tok/ --ray-address auto
"""


def _add_read_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("reading the input")
    group.add_argument("--input", nargs="+", required=True, metavar="PATH",
                       help="files, directories or globs; local paths or pyarrow filesystem URIs")
    group.add_argument("--text-format", choices=["paragraphs", "lines", "file"], default="paragraphs",
                       help="plain text: documents separated by blank lines, one per line, or one per file")
    group.add_argument("--text-field", default="text", help="JSONL field holding the text")
    group.add_argument("--text-column", default="text", help="Parquet column holding the text")
    group.add_argument("--bad-utf8", choices=["replace", "skip"], default="replace",
                       help="invalid UTF-8: repair with U+FFFD or skip the document (counted either way)")
    group.add_argument("--bad-json", choices=["error", "skip"], default="error",
                       help="a JSONL line that is not JSON or lacks the field: stop, or skip and count")


def _read_options(args: argparse.Namespace) -> ReadOptions:
    return ReadOptions(text_format=args.text_format, text_field=args.text_field, text_column=args.text_column,
                       bad_utf8=args.bad_utf8, bad_json=args.bad_json)


def _documents(inputs: list[str], options: ReadOptions, command: str | None = None) -> Iterator[str]:
    """Every document piece of the inputs, in corpus order (streamed); with a `command`, says
    which files it skipped as binary (prep says so itself)."""
    counters = ReadCounters()
    units = plan_units(resolve_inputs(inputs), options)
    for unit in units:
        for piece in read_unit(unit, options, counters):
            yield piece.text
    if command and counters.binary_files_skipped:
        skipped = [(unit.file.uri, reason) for unit in units
                   if unit.start == 0 and (reason := binary_reason(unit.file))]
        _warn(command, [f"tokenizer training skipped {len(skipped)} input file(s) as binary; leave them out, "
                        f"or convert UTF-16 text to UTF-8 (iconv -f UTF-16 -t UTF-8 IN > OUT.txt):",
                        *(f"  {uri}: {reason}" for uri, reason in skipped)])


def _warn(command: str, lines: list[str]) -> None:
    for line in lines:
        print(f"unmask {command}: warning: {line}", file=sys.stderr)


def _cmd_tokenizer_train(args: argparse.Namespace) -> int:
    options = _read_options(args)
    output_dir(args.out, "--out")  # before the training, not after it
    tokenizer = train_sentencepiece(_documents(args.input, options, "tokenizer"), args.out, args.vocab_size,
                                    args.model_type, seed=args.seed)
    print(f"trained a {args.model_type} sentencepiece tokenizer: {tokenizer.vocab_size} tokens, "
          f"sha256 {tokenizer.sha256[:12]}, in {args.out}")
    return 0


def _prep_tokenizer(args: argparse.Namespace, options: ReadOptions) -> Tokenizer:
    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    directory = Path(args.out) / TOKENIZER_SUBDIR
    request = {"inputs": args.input, "vocab_size": args.vocab_size, "model_type": "bpe",
               "seed": args.seed, "read": asdict(options)}
    marker = directory / TRAINING_REQUEST_NAME
    if marker.is_file() and json.loads(marker.read_text()) == request:
        return load_tokenizer(directory)
    tokenizer = train_sentencepiece(_documents(args.input, options), directory, args.vocab_size, seed=args.seed)
    atomic_write_bytes(marker, json.dumps(request, sort_keys=True).encode())
    return tokenizer


def _cmd_prep(args: argparse.Namespace) -> int:
    options = _read_options(args)
    config = PrepConfig(inputs=tuple(args.input), seq_len=args.seq_len, val_fraction=args.val_fraction,
                        seed=args.seed, read=options, shard_bytes=args.shard_bytes, unit_bytes=args.unit_bytes)
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    output_dir(args.out, "--out")  # before training a tokenizer into it
    tokenizer = _prep_tokenizer(args, options)
    result = prep(config, tokenizer, args.out, workers=args.workers, ray_address=args.ray_address,
                  overwrite=args.overwrite, progress=not args.no_progress,
                  tokenizer_follows_inputs=not args.tokenizer)
    _warn("prep", result.warnings())
    print(result.summary())
    if args.json:
        print(json.dumps({"nothing_to_do": result.nothing_to_do, "units_run": result.units_run,
                          "units_resumed": result.units_resumed, "shards_written": result.shards_written,
                          "shards_resumed": result.shards_resumed, "tokens_run": result.tokens_run,
                          "seconds": result.seconds,
                          "tokenize_seconds": result.tokenize_seconds}))
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``tokenizer`` and ``prep`` to the ``unmask`` command."""
    tokenizer = commands.add_parser("tokenizer", help="train a sentencepiece tokenizer",
                                    description="Tokenizer tools.")
    tokenizer_commands = tokenizer.add_subparsers(dest="tokenizer_command", metavar="COMMAND", required=True)
    train = tokenizer_commands.add_parser(
        "train", help="train a sentencepiece tokenizer on a deterministic sample of the input",
        description="Train a sentencepiece model (byte fallback on, normalization off: every UTF-8 "
                    "text round-trips exactly) on a bounded, deterministic sample of the input.",
        epilog=TOKENIZER_EPILOG, formatter_class=RAW)
    _add_read_arguments(train)
    train.add_argument("--vocab-size", type=int, required=True, help="number of tokens")
    train.add_argument("--out", required=True, help="output directory")
    train.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    train.add_argument("--seed", type=int, default=0, help="seed of the training sample")
    train.set_defaults(handler=_cmd_tokenizer_train)

    parser = commands.add_parser(
        "prep", help="tokenize corpora into sharded WebDataset files with Ray",
        description="Read, tokenize (Ray actors), append EOS per document, pack into fixed-length "
                    "sequences and write DIR/{train,val}/shard-NNNNNN.tar and DIR/manifest.json. "
                    "Idempotent and resumable: rerunning a finished prep does nothing; rerunning a "
                    "killed one finishes it without redoing finished work.",
        epilog=PREP_EPILOG, formatter_class=RAW)
    _add_read_arguments(parser)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per packed sequence")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokenizer", help="a sentencepiece .model, a trained tokenizer directory, "
                                            "or a directory with GPT-2's encoder.json and vocab.bpe")
    source.add_argument("--vocab-size", type=int, help="train a sentencepiece tokenizer of this size first")
    parser.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                        help="share of documents held out, by a hash of their content")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer actors")
    parser.add_argument("--ray-address", help="run on this Ray cluster (default: a local Ray)")
    parser.add_argument("--seed", type=int, default=0, help="keys the train/val hash")
    parser.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, help="target shard size")
    parser.add_argument("--unit-bytes", type=int, default=DEFAULT_UNIT_BYTES,
                        help="input bytes per work unit (parallelism within big files)")
    parser.add_argument("--overwrite", action="store_true", help="replace a different prep in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--json", action="store_true", help="also print the run's figures as JSON")
    parser.set_defaults(handler=_cmd_prep)
