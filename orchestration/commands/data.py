"""The ``unmask tokenizer train`` and ``unmask prep`` commands."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from data_prep.prep import PrepRequest, prep
from data_prep.readers import DEFAULT_UNIT_BYTES, ReadOptions
from data_prep.resume import WORK_DIR
from data_prep.shards.storage import check_writable, default_cache_dir, is_remote, upload_data
from data_prep.tokenizer.hugging_face import ROLE_FLAGS, SpecialTokens
from data_prep.tokenizer.training import TrainingRequest, train_tokenizer
from data_prep.write_shards import DEFAULT_SHARD_BYTES, DEFAULT_VAL_FRACTION, PrepConfig

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
  unmask prep --input corpus/ --out shards/ --seq-len 512 --tokenizer my-tokenizer/tokenizer.json \\
      --eos-token "</s>"
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


def _warn(command: str, lines: list[str], level: str = "warning") -> None:
    for line in lines:
        print(f"unmask {command}: {level}: {line}", file=sys.stderr)


def _cmd_tokenizer_train(args: argparse.Namespace) -> int:
    request = TrainingRequest(tuple(args.input), args.vocab_size, args.model_type, args.seed, _read_options(args))
    trained = train_tokenizer(request, args.out)
    _warn("tokenizer", trained.warnings)
    tokenizer = trained.tokenizer
    print(f"trained a {args.model_type} sentencepiece tokenizer: {tokenizer.vocab_size} tokens, "
          f"sha256 {tokenizer.sha256[:12]}, in {args.out}")
    return 0


def _local_out(out: str) -> Path:
    """Where the prep writes: ``out``, or for a URI a local staging directory named by it
    (a rerun resumes there, then uploads what the store lacks), once the store has shown
    that it takes objects there: a refusal comes before the prep, not after it."""
    if not is_remote(out):
        return Path(out)
    check_writable(out, "--out")
    return default_cache_dir() / "prep-staging" / hashlib.sha256(out.encode()).hexdigest()[:24]


def _cmd_prep(args: argparse.Namespace) -> int:
    config = PrepConfig(inputs=tuple(args.input), seq_len=args.seq_len, val_fraction=args.val_fraction,
                        seed=args.seed, read=_read_options(args), shard_bytes=args.shard_bytes,
                        unit_bytes=args.unit_bytes)
    special_tokens = SpecialTokens(eos=args.eos_token, bos=args.bos_token, pad=args.pad_token)
    out = _local_out(args.out)
    result = prep(PrepRequest(config, out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                              special_tokens=special_tokens, workers=args.workers,
                              ray_address=args.ray_address, overwrite=args.overwrite,
                              progress=not args.no_progress))
    _warn("prep", result.notes(), level="note")
    _warn("prep", result.warnings())
    print(result.summary())
    if is_remote(args.out):
        sent = upload_data(out, args.out, skip=(WORK_DIR,))
        print(f"uploaded {sent} file(s) to {args.out} (the manifest last)")
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
    train.add_argument("--out", required=True, help="output directory: new or empty, or an earlier tokenizer "
                                                    "(replaced whole)")
    train.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    train.add_argument("--seed", type=int, default=0, help="seed of the training sample")
    train.set_defaults(handler=_cmd_tokenizer_train)

    parser = commands.add_parser(
        "prep", help="tokenize corpora into sharded WebDataset files with Ray",
        description="Read, tokenize (in this process, or Ray actors with --workers > 1), append EOS "
                    "per document, pack into fixed-length sequences and write DIR/{train,val}/shard-NNNNNN.tar and DIR/manifest.json. "
                    "Idempotent and resumable: rerunning a finished prep does nothing; rerunning a "
                    "killed one finishes it without redoing finished work.",
        epilog=PREP_EPILOG, formatter_class=RAW)
    _add_read_arguments(parser)
    parser.add_argument("--out", required=True, help="output directory (or s3://bucket/prefix: prepped locally, then "
                        "uploaded, the manifest last): new or empty, or a prep's (resumed; "
                                                     "another prep's with --overwrite)")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per packed sequence")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokenizer", help="a sentencepiece .model, a trained tokenizer directory, a "
                                            "directory with GPT-2's encoder.json and vocab.bpe, or a Hugging "
                                            "Face tokenizer.json (the file, or a directory holding it)")
    source.add_argument("--vocab-size", type=int, help="train a sentencepiece tokenizer of this size first")
    roles = parser.add_argument_group(
        "special tokens of a tokenizer.json (default: named by special_tokens_map.json or tokenizer_config.json "
        "beside it, else found among its special tokens by their usual names)")
    for role, what in (("eos", "ends each document (needed where the files name none)"), ("bos", "begins a sequence"),
                       ("pad", "pads the last sequence (default: eos)")):
        roles.add_argument(ROLE_FLAGS[role], metavar="TOKEN", help=f"the token that {what}")
    parser.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                        help="share of documents held out, by a hash of their content")
    parser.add_argument("--workers", type=int, default=1,
                        help="tokenizer workers: 1 runs in this process, more are Ray actors")
    parser.add_argument("--ray-address", help="run on this Ray cluster (default: a local Ray)")
    parser.add_argument("--seed", type=int, default=0, help="keys the train/val hash")
    parser.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, help="target shard size")
    parser.add_argument("--unit-bytes", type=int, default=DEFAULT_UNIT_BYTES,
                        help="input bytes per work unit (parallelism within big files)")
    parser.add_argument("--overwrite", action="store_true", help="replace a different prep in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--json", action="store_true", help="also print the run's figures as JSON")
    parser.set_defaults(handler=_cmd_prep)
