"""``unmask run``: every stage in one run directory (``orchestration.stages``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from common.logs import configure_logging
from data_prep.readers import ReadOptions
from orchestration.commands.evaluate import QUICK_BLOCKS_PER_REPLICATE
from orchestration.commands.sampling_flags import (
    REPORT_FLAGS,
    REPORT_SAMPLER_HELP,
    add_sampling_arguments,
    check_flags_apply,
    check_samples_drawn,
    plan_from_args,
)
from orchestration.commands.train import RAW, add_init_arguments, add_launcher_arguments, init_from_args, launch_of
from orchestration.exit_codes import OK, PREEMPTED
from pipeline.config import config_yaml, load_config, parse_overrides

if TYPE_CHECKING:
    from orchestration.stages import RunSummary

RUN_EPILOG = f"""\
{REPORT_SAMPLER_HELP}
config overrides: any --SECTION.FIELD VALUE after the flags, e.g. --train.max_steps 50

examples:
  unmask run                                   # the demo: CPython's docs, configs/demo.yaml, runs/demo
  unmask run --config configs/tiny.yaml --input corpus/*.jsonl --run-dir runs/tiny \\
      --datasets val,ptb,wikitext2 --data-dir ../shared/data
  unmask submit --address http://HEAD:8265 -- run --config configs/small.yaml --input s3://b/owt/ \\
      --run-dir /shared/runs/small --launcher ray --num-workers 8 --gpus-per-worker 1
"""


def _cmd_run(args: argparse.Namespace) -> int:
    from orchestration.stages import DEMO_CONFIG, EvalStage, Preempted, RunRequest, run_pipeline

    overrides = parse_overrides(args.overrides)
    if args.mlflow_uri is not None:
        overrides["logging.mlflow_uri"] = args.mlflow_uri
    config_path = Path(args.config) if args.config else DEMO_CONFIG
    config = load_config(config_path, overrides)  # the one load: every stage gets this config
    if args.print_config:
        print(config_yaml(config), end="")
        return 0
    read = ReadOptions(**{name: value for name, value in (("text_format", args.text_format),
                                                          ("text_field", args.text_field),
                                                          ("text_column", args.text_column)) if value})
    check_samples_drawn(args, REPORT_FLAGS, args.num_samples)
    check_flags_apply(args, REPORT_FLAGS, config.model.objective, f"the config ({config_path}: model.objective)")
    ray_launch = launch_of(args) if args.launcher == "ray" else None
    request = RunRequest(
        run_dir=Path(args.run_dir or Path("runs") / config_path.stem), config=config,
        inputs=tuple(args.input or ()), read=read, seq_len=args.seq_len, val_fraction=args.val_fraction,
        tokenizer=args.tokenizer, vocab_size=args.vocab_size, prep_workers=args.prep_workers,
        ray_address=args.ray_address, launch=ray_launch, init_from=init_from_args(args),
        evaluation=EvalStage(datasets=tuple(name.strip() for name in args.datasets.split(",") if name.strip()),
                             data_dir=args.data_dir, samples_per_block=args.samples, num_samples=args.num_samples,
                             blocks_per_replicate=QUICK_BLOCKS_PER_REPLICATE if args.quick else None,
                             sampling=plan_from_args(args, REPORT_FLAGS, seed=0)))
    configure_logging()
    try:
        summary = run_pipeline(request, hooks=args.hooks)
    except Preempted as stopped:
        print(f"unmask run: {stopped}", file=sys.stderr)
        return PREEMPTED
    _print_run_summary(summary)
    return OK


def _print_run_summary(summary: RunSummary) -> None:
    print(f"\nunmask run: finished in {summary.seconds:.0f} s: {summary.run_dir}")
    for stage, outcome in summary.stages.items():
        print(f"  {stage:>6}: {outcome}")
    if summary.init_from:
        print(f"  started from: {summary.init_from['kind']} {summary.init_from['source']} "
              f"({summary.init_from['weights']} weights)")
    training = summary.training
    if training:
        print(f"  bound on the validation split: {training.untrained_val_nelbo_per_token:.3f} nats/token "
              f"untrained -> {training.final_val_nelbo_per_token:.3f} at step {training.final_step}")
    for name, record in summary.datasets.items():
        print(f"  {name}: perplexity <= {record['perplexity_bound']:.2f}, {record['nelbo_per_token']:.4f} "
              f"nats/token, {record['bits_per_byte']:.4f} bits/byte")
    print(f"  report: {summary.report}")
    mlflow = summary.mlflow
    print(f"  MLflow: run {mlflow['run_id']} at {mlflow['tracking_uri']}" if mlflow else
          "  MLflow: not logged (the server did not answer; see the warning above)")


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``run`` (every stage, each skipped when up to date) to the ``unmask`` command."""
    run = commands.add_parser(
        "run", help="prep -> train -> export -> eval -> report in one run directory (idempotent)",
        description="Run every stage in RUN: prep into RUN/data, train, export, evaluate and write "
                    "RUN/report/. Each stage is skipped when its output is up to date, so a rerun "
                    "continues where a failed or killed one stopped. With no --input: the "
                    "documentation text shipped with CPython and configs/demo.yaml.",
        epilog=RUN_EPILOG, formatter_class=RAW)
    run.add_argument("--config", help="YAML config (default configs/demo.yaml)")
    run.add_argument("--input", nargs="+", metavar="PATH", help="corpus files, directories, globs or URIs "
                                                                "(default: the built-in CPython docs)")
    run.add_argument("--run-dir", help="the run directory (default runs/CONFIG_NAME)")
    prep = run.add_argument_group("data (unmask prep)")
    prep.add_argument("--text-format", choices=["paragraphs", "lines", "file"])
    prep.add_argument("--text-field", help="JSONL field holding the text")
    prep.add_argument("--text-column", help="Parquet column holding the text")
    prep.add_argument("--seq-len", type=int, help="tokens per sequence (default: model.max_seq_len or the preset's)")
    prep.add_argument("--val-fraction", type=float, help="share of documents held out (default: prep's; "
                                                         "5%% for the built-in corpus)")
    prep.add_argument("--tokenizer", help="an existing tokenizer (default: train a sentencepiece one)")
    prep.add_argument("--vocab-size", type=int, default=4096, help="size of the trained tokenizer (default 4096)")
    prep.add_argument("--prep-workers", type=int, default=1, help="tokenizer actors")
    evaluation = run.add_argument_group("evaluation (unmask eval)")
    evaluation.add_argument("--datasets", default="val", help="comma-separated (default val: the held-out split)")
    evaluation.add_argument("--data-dir", help="root of the standard eval files (layout of ../shared/data)")
    evaluation.add_argument("--samples", type=int, default=16, help="time samples per block K (default 16)")
    evaluation.add_argument("--quick", action="store_true",
                            help="score a random 64 blocks per time sample (unmask eval --quick): minutes, "
                                 "an honest but wider interval")
    evaluation.add_argument("--num-samples", type=int, default=2, help="generated samples in the report")
    add_sampling_arguments(evaluation, REPORT_FLAGS)
    add_init_arguments(run)
    run.add_argument("--mlflow-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else "
                                              "the shared store ~/.unmask/mlflow)")
    run.add_argument("--print-config", action="store_true",
                     help="print the resolved training config (YAML) and exit")
    add_launcher_arguments(run)
    run.set_defaults(handler=_cmd_run, accepts_overrides=True)
