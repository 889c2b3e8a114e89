"""The ``unmask train`` and ``unmask export`` commands."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from pipeline.config import load_config, parse_overrides
from pipeline.errors import UserError

RAW = argparse.RawDescriptionHelpFormatter

TRAIN_EPILOG = """\
config overrides: any --SECTION.FIELD VALUE after the flags, e.g. --optim.lr 1e-4 --train.zero_stage 2

examples:
  unmask train --config configs/tiny.yaml --data shards/ --run-dir runs/tiny
  unmask train --config configs/medium.yaml --data shards/ --run-dir runs/m --train.max_steps 20000
  torchrun --nproc-per-node 8 -m pipeline.cli train --config configs/medium.yaml --data shards/ --run-dir runs/m
  deepspeed --hostfile hostfile --module pipeline.cli train --config configs/medium.yaml --data shards/ --run-dir runs/m
"""

EXPORT_EPILOG = """\
examples:
  unmask export runs/tiny                  # latest checkpoint, EMA weights -> runs/tiny/export/
  unmask export runs/tiny --checkpoint 200 --weights model
"""


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        from deepspeed.utils import logger as deepspeed_logger
    except ImportError:
        return
    deepspeed_logger.setLevel(logging.WARNING)  # DeepSpeed logs its whole config at INFO


def _cmd_train(args: argparse.Namespace) -> int:
    from pipeline.trainer import train

    overrides = parse_overrides(args.overrides)
    if args.data is not None:
        overrides["data.path"] = args.data
    if args.mlflow_uri is not None:
        overrides["logging.mlflow_uri"] = args.mlflow_uri
    if args.no_progress:
        overrides["logging.progress"] = "false"
    config = load_config(args.config, overrides)
    if config.data.path is None:
        raise UserError("no data: pass --data DIR (an `unmask prep --out` directory) or set data.path")
    _configure_logging()
    result = train(config, data_dir=config.data.path, run_dir=args.run_dir, resume=args.resume,
                   allow_config_change=args.allow_config_change)
    summary = {"run_dir": str(result.run_dir), "step": result.step, "tokens_seen": result.tokens_seen,
               "checkpoint": str(result.checkpoint), "preempted": result.preempted,
               "mlflow_run_id": result.mlflow_run_id}
    if result.validation is not None:
        summary["val_nelbo_per_token"] = result.validation.nelbo_per_token
        summary["val_bits_per_byte"] = result.validation.bits_per_byte
    if os.environ.get("RANK", "0") == "0":  # one summary per job, not per process
        print(json.dumps(summary))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from pipeline.export import export

    out = export(args.run_dir, step=args.checkpoint, weights=args.weights, out_dir=args.out)
    print(f"exported {args.weights} weights to {out}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``train`` and ``export`` to the ``unmask`` command."""
    train = commands.add_parser(
        "train", help="pretrain with DeepSpeed ZeRO on the shards of `unmask prep`",
        description="Train the masked diffusion transformer (or the AR baseline) on prepared shards. "
                    "Runs alone, or in every process started by torchrun / deepspeed. Checkpoints "
                    "every checkpoint.every steps, at the end and on SIGTERM; --resume auto continues "
                    "exactly where the run stopped.",
        epilog=TRAIN_EPILOG, formatter_class=RAW)
    train.add_argument("--config", help="YAML config (configs/tiny.yaml, small.yaml, medium.yaml)")
    train.add_argument("--data", help="shard directory (overrides data.path)")
    train.add_argument("--run-dir", required=True, help="checkpoints, metrics, MLflow store, export")
    train.add_argument("--resume", choices=["auto", "never"], default="auto",
                       help="auto: continue from the latest checkpoint if any (default); never: refuse "
                            "a run dir that has checkpoints")
    train.add_argument("--allow-config-change", action="store_true",
                       help="resume even though the config or data differ from the checkpoint's")
    train.add_argument("--mlflow-uri", help="MLflow tracking server (default: sqlite in the run dir)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # deepspeed launcher
    train.set_defaults(handler=_cmd_train, accepts_overrides=True)

    export = commands.add_parser(
        "export", help="write RUN/export/: model.safetensors (EMA), config.json, tokenizer",
        description="Export a checkpoint as one safetensors file (EMA weights gathered from any ZeRO "
                    "stage), its config and its tokenizer; loadable without DeepSpeed.",
        epilog=EXPORT_EPILOG, formatter_class=RAW)
    export.add_argument("run_dir", metavar="RUN", help="the training run directory")
    export.add_argument("--checkpoint", type=int, metavar="STEP", help="checkpoint step (default: latest)")
    export.add_argument("--weights", choices=["ema", "model"], default="ema")
    export.add_argument("--out", help="output directory (default: RUN/export)")
    export.set_defaults(handler=_cmd_export)
