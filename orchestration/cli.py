"""The ``unmask`` command line: the top of the house. Each group of subcommands lives in
``orchestration.commands``; below this floor everything is a library."""

from __future__ import annotations

import argparse
import logging
import multiprocessing.util
import os
import platform
import signal
import sys
from typing import NoReturn

import orchestration.interruption  # noqa: F401  first: from here on a signal ends a command in one line
from common.errors import UserError
from common.provenance import package_version
from orchestration.commands import (
    config,
    data,
    distill,
    downstream,
    evaluate,
    importing,
    jobs,
    run,
    sample,
    sweep,
    train,
)
from orchestration.exit_codes import USER_ERROR
from orchestration.interruption import Terminated, command_of, exit_status, handled_signals, stop_line
from pipeline.training.hooks import TrainHooks

DESCRIPTION = """\
unmask: pretrain and evaluate masked diffusion language models (MDLM / MD4).

Stages: tokenize and shard corpora, train with DeepSpeed ZeRO, export, evaluate
zero-shot perplexity bounds. Run `unmask COMMAND --help` for each command.
"""

EPILOG = """\
examples:
  unmask tokenizer train --input corpus/ --vocab-size 32000 --out tok/
  unmask prep --input corpus/ --out shards/ --seq-len 1024 --tokenizer tok/ --workers 4
  unmask train --config configs/tiny.yaml --data shards/ --run-dir runs/tiny
  unmask export runs/tiny
  unmask distill runs/tiny --config distill.yaml --data shards/ --run-dir runs/tiny-sdtt
  unmask import mdlm mdlm-owt/ --tokenizer ../shared/data/gpt2-bpe --out mdlm-export/
  unmask eval runs/tiny --datasets ptb,wikitext2,lambada,lm1b --data-dir ../shared/data
  unmask lm-eval runs/tiny --tasks lambada_openai_local,ptb_word_order --data-dir ../shared/data
  unmask sample runs/tiny --num 4 --steps 1000 --prompt "ROMEO:"
  unmask run                                  # the whole pipeline on a built-in corpus
  unmask submit --address http://HEAD:8265 -- run --config configs/small.yaml --input /shared/owt
  unmask jobs logs JOB_ID --follow
  unmask sweep configs/sweep-cpu.yaml --out runs/sweep-cpu
  unmask version --all
"""

# Reported by `unmask version`: the packages whose versions decide numerical results.
REPORTED_PACKAGES = ("torch", "deepspeed", "ray", "mlflow", "webdataset", "sentencepiece", "tiktoken", "tokenizers")


def _cmd_version(args: argparse.Namespace) -> int:
    print(f"unmask {package_version('unmask')}")
    if args.all:
        print(f"python {platform.python_version()}")
        for name in REPORTED_PACKAGES:
            print(f"{name} {package_version(name)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unmask", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = commands.add_parser(
        "version", help="print the unmask version",
        description="Print the unmask version (with --all, Python and dependency versions too).",
        epilog="example:\n  unmask version --all", formatter_class=argparse.RawDescriptionHelpFormatter)
    version.add_argument("--all", action="store_true", help="also print Python and dependency versions")
    version.set_defaults(handler=_cmd_version)
    for group in (data, train, distill, importing, run, evaluate, downstream, sample, jobs, config, sweep):
        group.register(commands)
    return parser


def main(argv: list[str] | None = None, *, hooks: TrainHooks = TrainHooks()) -> int:
    """Run ``unmask ARGV``; the exit status. ``hooks`` run inside every training loop the
    command starts (a script embedding the command line may watch or pause its steps)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with handled_signals():
        try:
            status = _run(argv, hooks)
        except (Terminated, KeyboardInterrupt) as stop:
            signum = signal.SIGINT if isinstance(stop, KeyboardInterrupt) else signal.SIGTERM
            print(stop_line(command_of(argv), signum), file=sys.stderr)
            status = exit_status(command_of(argv), signum)
    return status


def entry_point() -> NoReturn:
    """The ``unmask`` console script and ``python -m orchestration.cli``: ``main``, then the end."""
    end_process(main())


def end_process(status: int) -> NoReturn:
    """End this process with ``status``. One rank of a launcher's job (torchrun, deepspeed:
    WORLD_SIZE > 1) ends without the interpreter's teardown: there a C++ thread of gloo or
    DeepSpeed that still holds a Python object can take the rank down ("terminate called without
    an active exception", SIGABRT), failing a job whose every checkpoint and record is written."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        # The exit finalizers os._exit would skip: they unlink the stop event's semaphores
        # (common.stop_request), which the resource tracker would otherwise report as leaked.
        multiprocessing.util._run_finalizers(0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def _run(argv: list[str], hooks: TrainHooks) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides, args.hooks = extra, hooks
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.handler(args)
    except UserError as err:
        print(f"unmask {args.command}: error: {err}", file=sys.stderr)
        return USER_ERROR


if __name__ == "__main__":
    entry_point()
