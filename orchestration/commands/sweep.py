"""``unmask sweep``: an isoFLOP scaling study on Ray (``orchestration.sweep``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.logs import configure_logging
from orchestration.exit_codes import FAILED_PARTS, OK
from orchestration.sweep.plan import budget_name

RAW = argparse.RawDescriptionHelpFormatter

EPILOG = """\
examples:
  unmask sweep configs/sweep-cpu.yaml --out runs/sweep-cpu --dry-run     # the trials, their steps
  unmask sweep configs/sweep-cpu.yaml --out runs/sweep-cpu               # a local Ray
  unmask sweep configs/sweep-gpu.yaml --out /shared/sweeps/owt --address auto   # a cluster
  rerun the same command to continue: finished trials are kept, interrupted ones resume,
  failed ones run again (docs/scaling.md)
"""


def _print_plan(plan) -> None:
    print(f"{len(plan.trials)} trials on {plan.data} (sequence length {plan.seq_len}, "
          f"{plan.train_tokens} train tokens):")
    for trial in plan.trials:
        print(f"  {trial.name}: C {budget_name(trial.budget)}, N {trial.parameters:,}, "
              f"{trial.flops_per_token:.4g} FLOPs/token, {trial.steps} steps of {trial.tokens_per_step} tokens")


def _cmd_sweep(args: argparse.Namespace) -> int:
    from orchestration.sweep import SweepRequest, load_sweep, plan_sweep, run_sweep

    if args.dry_run:
        _print_plan(plan_sweep(load_sweep(args.sweep_file)))
        return OK
    configure_logging()
    request = SweepRequest(sweep_file=args.sweep_file, out=args.out, address=args.address, num_cpus=args.num_cpus)
    report = run_sweep(request, hooks=args.hooks)
    if report.failed:
        print(f"unmask sweep: {len(report.failed)} trial(s) failed after their retries: {', '.join(report.failed)}; "
              f"their errors are in {args.out / 'report' / 'summary.md'}; rerun the same command to run them "
              f"again", file=sys.stderr)
        return FAILED_PARTS
    return OK


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``sweep`` to the ``unmask`` command."""
    sweep = commands.add_parser(
        "sweep", help="isoFLOP scaling study: trials on Ray, fitted laws and plots",
        description="Train every (process, FLOP budget, model size) of a sweep file as a Ray task, each an "
                    "unmask run directory under OUT/trials/, then fit the isoFLOP minima, N_opt(C) and L_opt(C) "
                    "and the compute multiplier between processes, and plot them (OUT/report/).",
        epilog=EPILOG, formatter_class=RAW)
    sweep.add_argument("sweep_file", type=Path, metavar="SWEEP.yaml", help="the sweep file (docs/scaling.md)")
    sweep.add_argument("--out", type=Path, required=True, help="the sweep's directory (new, or a sweep's to continue)")
    sweep.add_argument("--address", help="a Ray cluster (HEAD:6379, ray://HEAD:10001, auto); default: a local Ray")
    sweep.add_argument("--num-cpus", type=int, help="CPUs of the local Ray (default: the machine's)")
    sweep.add_argument("--dry-run", action="store_true", help="print the trials and their steps; run nothing")
    sweep.set_defaults(handler=_cmd_sweep)
