"""The ``unmask train`` and ``unmask export`` commands."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from common.errors import UserError
from common.logs import configure_logging
from common.outputs import check_output_dir
from data_prep.shards.storage import cache_root, is_remote, read_manifest
from orchestration.exit_codes import OK, PREEMPTED, USER_ERROR
from pipeline.config import Config, config_yaml, distillation_config, load_config, parse_overrides
from pipeline.run_dir.layout import RUN_KIND, training_data
from pipeline.training.init_from import InitFrom, init_inputs

if TYPE_CHECKING:
    from orchestration.cluster.ray_train import RayLaunch

RAW = argparse.RawDescriptionHelpFormatter

TRAIN_EPILOG = """\
config overrides: any --SECTION.FIELD VALUE after the flags, e.g. --optim.lr 1e-4 --train.zero_stage 2

examples:
  unmask train --config configs/tiny.yaml --data shards/ --run-dir runs/tiny
  unmask train --config configs/medium.yaml --data shards/ --run-dir runs/m --train.max_steps 20000
  unmask train --config ft.yaml --data shards/ --run-dir runs/ft --init-from runs/tiny   # a new run from its weights
  unmask train --config configs/adapt-gpt2-medium.yaml --data shards/ --run-dir runs/diffugpt \
      --init-from gpt2-medium/    # adapt a Hugging Face causal LM (or an unmask AR run) into diffusion
  torchrun --nproc-per-node 8 -m orchestration.cli train --config configs/medium.yaml --data shards/ --run-dir runs/m
  deepspeed --hostfile hostfile --module orchestration.cli train --config configs/medium.yaml --data shards/ --run-dir runs/m
  unmask train --launcher ray --num-workers 8 --gpus-per-worker 1 --max-failures 3 --ray-address auto \
      --storage s3://bucket/runs/m --config configs/medium.yaml --data /shared/shards --run-dir /shared/runs/m
"""

EXPORT_EPILOG = """\
formats:
  unmask  model.safetensors (EMA), config.json, tokenizer/: what unmask eval and unmask sample read
  hf      a transformers directory: AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)
          gives the same logits (config.json, model.safetensors, modeling_unmask.py, tokenizer files)

examples:
  unmask export runs/tiny                  # latest checkpoint, EMA weights -> runs/tiny/export/
  unmask export runs/tiny --checkpoint 200 --weights model
  unmask export runs/tiny --format hf      # -> runs/tiny/export-hf/
  unmask export mdlm-export/ --format hf --out mdlm-hf/   # an export (e.g. of unmask import) to transformers
"""


def _train_config(args: argparse.Namespace) -> Config:
    overrides = parse_overrides(args.overrides)
    if args.data is not None:
        overrides["data.path"] = args.data
    if args.mlflow_uri is not None:
        overrides["logging.mlflow_uri"] = args.mlflow_uri
    if args.no_progress:
        overrides["logging.progress"] = "false"
    config = load_config(args.config, overrides)
    if args.command == "distill":
        return distillation_config(config, max_steps_given="train.max_steps" in overrides)
    if config.distill.enabled:
        raise UserError("config field distill.enabled = true: `unmask distill TEACHER` starts a distillation (and "
                        "sets it); remove it from the config of `unmask train`")
    return config


def _check_paths(args: argparse.Namespace, config: Config) -> None:
    """The data and run directories, before DeepSpeed or Ray start. With --launcher ray and
    --ray-address they are the cluster's paths, which this machine may not see: not checked."""
    if config.data.path is None:
        raise UserError("no data: pass --data DIR (an `unmask prep --out` directory) or set data.path")
    if args.run_dir is None:
        raise UserError("--run-dir is required: where the checkpoints, metrics and export go")
    if args.launcher == "ray" and args.ray_address is not None:
        return
    if is_remote(config.data.path):  # object storage: its manifest says whether a prep finished there
        read_manifest(config.data.path)
        cache_root(config.data.cache_dir)  # where its manifest, tokenizer and chunks are kept
        check_output_dir(args.run_dir, RUN_KIND, "--run-dir", [])
        return
    data = Path(config.data.path)
    if not data.is_dir():
        raise UserError(f"--data {config.data.path} (data.path): {'is a file' if data.exists() else 'does not exist'}"
                        f"; pass the --out directory of `unmask prep`")
    if not (data / "manifest.json").is_file():
        raise UserError(f"--data {config.data.path} (data.path): no manifest.json, so not the output of a "
                        f"finished `unmask prep`; run (or rerun) `unmask prep --out {config.data.path}`")
    check_output_dir(args.run_dir, RUN_KIND, "--run-dir", [training_data(config.data.path),
                                                           *init_inputs(init_from_args(args))])


def _checked_config(args: argparse.Namespace) -> Config:
    """The config, its batches spread over the ranks the launcher starts, before anything
    else: every rank of a job reads the same config and meets the same mistake in it."""
    config = _train_config(args)
    ranks = args.num_workers if args.launcher == "ray" else int(os.environ.get("WORLD_SIZE", "1"))
    if not args.print_config and ranks >= 1:  # (fewer Ray workers are refused with the launch's flags)
        from pipeline.training.engine import plan_batches

        plan_batches(config, ranks)
    return config


def train_command(args: argparse.Namespace) -> int:
    """``unmask train`` (and ``unmask distill``, whose arguments are train's and a teacher)."""
    try:
        config = _checked_config(args)
    except UserError:
        if os.environ.get("RANK", "0") != "0":  # rank 0 says it, once for the job
            return USER_ERROR
        raise
    if args.print_config:
        print(config_yaml(config), end="")
        return 0
    _check_paths(args, config)
    configure_logging()
    if args.launcher == "ray":
        return _train_with_ray(args, config)
    from pipeline.training.trainer import train

    result = train(config, data_dir=config.data.path, run_dir=args.run_dir, resume=args.resume,
                   allow_config_change=args.allow_config_change, hooks=args.hooks, init_from=init_from_args(args))
    if os.environ.get("RANK", "0") == "0":  # one summary per job, not per process
        print(json.dumps(result.summary()))
    return PREEMPTED if result.preempted else OK


def launch_of(args: argparse.Namespace) -> RayLaunch:
    """The Ray Train launch that the launcher flags (``add_launcher_arguments``) ask for."""
    from orchestration.cluster.ray_train import RayLaunch

    return RayLaunch(num_workers=args.num_workers, gpus_per_worker=args.gpus_per_worker,
                     cpus_per_worker=args.cpus_per_worker, max_failures=args.max_failures,
                     address=args.ray_address, storage=args.storage)


def _train_with_ray(args: argparse.Namespace, config: Config) -> int:
    from orchestration.cluster.ray_train import launch

    summary = launch(config, launch_of(args), data_dir=config.data.path, run_dir=args.run_dir, resume=args.resume,
                     allow_config_change=args.allow_config_change, on_step=args.hooks.on_step,
                     init_from=init_from_args(args))
    print(json.dumps(summary))
    return PREEMPTED if summary.get("preempted") else OK


def _cmd_export(args: argparse.Namespace) -> int:
    from pipeline.interchange.export import export, export_to_hf
    from pipeline.run_dir.layout import RunLayout

    source = Path(args.run_dir)
    if not source.is_dir():
        raise UserError(f"{args.run_dir}: {'is a file' if source.exists() else 'does not exist'}, "
                        f"not a training run directory (the --run-dir of `unmask train`)")
    if args.format == "hf" and not RunLayout(source).is_training_run():
        if args.out is None or args.checkpoint is not None:
            raise UserError(f"{args.run_dir} is not a training run: to convert an export, name the new "
                            "directory with --out (and no --checkpoint)")
        print(f"exported {export_to_hf(source, args.out)} from the export {source}")
        return 0
    out = export(args.run_dir, step=args.checkpoint, weights=args.weights, out_dir=args.out, format=args.format)
    print(f"exported {args.weights} weights to {out}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``train`` and ``export`` to the ``unmask`` command."""
    train = commands.add_parser(
        "train", help="pretrain with DeepSpeed ZeRO on the shards of `unmask prep`",
        description="Train the masked diffusion transformer (or the AR baseline) on prepared shards. "
                    "Runs alone, or in every process started by torchrun / deepspeed. Checkpoints "
                    "every checkpoint.every steps, at the end and on SIGTERM, after which it exits 75 "
                    "(EX_TEMPFAIL: preempted, to be run again); --resume auto continues exactly where "
                    "the run stopped.",
        epilog=TRAIN_EPILOG, formatter_class=RAW)
    train.add_argument("--config", help="YAML config (configs/tiny.yaml, small.yaml, medium.yaml)")
    train.add_argument("--data", help="shard directory or its URI, s3://bucket/prefix (overrides data.path)")
    train.add_argument("--run-dir", help="checkpoints, metrics, export (required to train)")
    add_init_arguments(train)
    add_run_arguments(train)
    train.set_defaults(handler=train_command, accepts_overrides=True)

    export = commands.add_parser(
        "export", help="write RUN/export/: model.safetensors (EMA), config.json, tokenizer",
        description="Export a checkpoint as one safetensors file (EMA weights gathered from any ZeRO "
                    "stage), its config and its tokenizer; loadable without DeepSpeed. --format hf "
                    "writes a directory that Hugging Face transformers loads instead, from a checkpoint "
                    "or from an existing export.",
        epilog=EXPORT_EPILOG, formatter_class=RAW)
    export.add_argument("run_dir", metavar="RUN", help="the training run directory (with --format hf, or an export)")
    export.add_argument("--checkpoint", type=int, metavar="STEP", help="checkpoint step (default: latest)")
    export.add_argument("--weights", choices=["ema", "model"], default="ema")
    export.add_argument("--format", choices=["unmask", "hf"], default="unmask",
                        help="unmask: unmask's own export (default); hf: a transformers directory")
    export.add_argument("--out", help="output directory, new or empty or an earlier export of the format, replaced "
                                      "whole (default: RUN/export, RUN/export-hf with --format hf)")
    export.set_defaults(handler=_cmd_export)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """A training run's resume, tracking, output and launcher arguments (``train`` and ``distill``)."""
    parser.add_argument("--resume", choices=["auto", "never"], default="auto",
                        help="auto: continue from the latest checkpoint if any (default); never: refuse "
                             "a run dir that has checkpoints")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume even though the config or data differ from the checkpoint's")
    parser.add_argument("--mlflow-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else "
                                             "the shared store ~/.unmask/mlflow)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (YAML) and exit; `unmask config fields` explains each field")
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # deepspeed launcher
    add_launcher_arguments(parser)


def add_init_arguments(parser: argparse.ArgumentParser) -> None:
    """--init-from and --init-weights (``pipeline.training.init_from``), for ``train`` and ``run``."""
    parser.add_argument("--init-from", metavar="EXPORT_OR_RUN",
                        help="start a new run from these weights: an export (unmask export / unmask import), a run "
                             "directory (its newest intact checkpoint) or a Hugging Face causal LM directory (GPT-2, "
                             "Llama, Qwen2); the config may differ, the network's shape must not. An autoregressive "
                             "source of a diffusion config is adapted (its config's adapt: section, "
                             "docs/adapting.md). A run with checkpoints resumes from its own")
    parser.add_argument("--init-weights", choices=["ema", "model"],
                        help="of a run directory given to --init-from: its EMA (default) or live weights")


def init_from_args(args: argparse.Namespace) -> InitFrom | None:
    """The source that --init-from and --init-weights name, or None."""
    if args.init_from is None:
        if args.init_weights is not None:
            raise UserError("--init-weights chooses the weights of --init-from's run directory; pass --init-from too")
        return None
    return InitFrom(args.init_from, args.init_weights)


def add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("launching on Ray (orchestration.cluster.ray_train)")
    group.add_argument("--launcher", choices=["local", "ray"], default="local",
                       help="local: this process (or each process torchrun/deepspeed started); ray: "
                            "Ray Train workers, restarted from the latest checkpoint on failure")
    group.add_argument("--num-workers", type=int, default=1, help="Ray Train workers (one rank each)")
    group.add_argument("--gpus-per-worker", type=float, default=0.0, help="0: CPU workers with gloo")
    group.add_argument("--cpus-per-worker", type=float, default=1.0)
    group.add_argument("--max-failures", type=int, default=0,
                       help="worker-group restarts before the run fails (-1: no limit)")
    group.add_argument("--ray-address", help="Ray cluster to join (default: the job's cluster, else a local Ray)")
    group.add_argument("--storage", help="also copy each checkpoint here (path or pyarrow URI such as "
                                         "s3://bucket/runs); a restarted group restores newer ones from it")
