"""The ``unmask distill`` command: self-distillation through time of an export or a run, on the
trainer of ``unmask train`` (``pipeline.training.distillation``). The manual:
docs/fast-generation.md#self-distillation."""

from __future__ import annotations

import argparse

from orchestration.commands.train import RAW, add_run_arguments, train_command

DISTILL_EPILOG = """\
The config is a training config (configs/tiny.yaml, ...) with a distill: section; the network is
the teacher's. train.max_steps is set to the rounds' steps (distill.round_steps per round).
config overrides: any --SECTION.FIELD VALUE after the flags, e.g. --distill.divergence forward_kl

examples:
  unmask distill runs/tiny --config distill.yaml --data shards/ --run-dir runs/tiny-sdtt
  unmask distill mdlm-export/ --config distill.yaml --data shards/ --run-dir runs/sdtt \\
      --distill.start_steps 1024 --distill.end_steps 16 --distill.round_steps 10000
  unmask export runs/tiny-sdtt && unmask sample runs/tiny-sdtt --num 4 --steps 16
"""


def _cmd_distill(args: argparse.Namespace) -> int:
    args.init_from, args.init_weights = args.teacher, args.teacher_weights
    return train_command(args)


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``distill`` to the ``unmask`` command."""
    distill = commands.add_parser(
        "distill", help="distil a model into one that samples in fewer steps (SDTT)",
        description="Self-distillation through time: a student, started from the teacher's weights, learns "
                    "to do in one sampling step what the teacher does in two; each round halves the steps "
                    "(distill.start_steps -> distill.end_steps) and its student becomes the next teacher. The "
                    "run is a training run: checkpoints, MLflow, exit 75 on SIGTERM, and the same command "
                    "resumes it; `unmask export` makes the student an ordinary export.",
        epilog=DISTILL_EPILOG, formatter_class=RAW)
    distill.add_argument("teacher", metavar="RUN_OR_EXPORT",
                         help="the teacher: an export (unmask export / unmask import) or a training run directory "
                              "(its newest intact checkpoint)")
    distill.add_argument("--teacher-weights", choices=["ema", "model"],
                         help="of a run directory given as the teacher: its EMA (default) or live weights")
    distill.add_argument("--config", help="YAML training config with a distill: section")
    distill.add_argument("--data", help="shard directory or its URI (overrides data.path): the teacher's data")
    distill.add_argument("--run-dir", help="the student's run: checkpoints, teachers, metrics, export")
    add_run_arguments(distill)
    distill.set_defaults(handler=_cmd_distill, accepts_overrides=True)
