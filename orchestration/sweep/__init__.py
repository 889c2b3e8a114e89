"""``unmask sweep SWEEP.yaml``: an isoFLOP scaling study as one command.

The sweep file (``spec``) becomes trials (``plan``: every process x budget x size, its steps from
the budget), which run as Ray tasks on a local Ray or a cluster (``trials``), each an ordinary run
directory under ``SWEEP/trials/``; the sweep's MLflow parent run adopts each trial's training run
as a child (``tracking``); the report fits the scaling laws and plots them (``report``). A rerun
with the same sweep directory keeps finished trials, resumes interrupted ones and retries failed
ones. The sweep directory is an output of its own kind (``common.outputs``). The manual:
docs/scaling.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.outputs import InputPath, OutputKind, claim_output_dir
from common.ray_runtime import ray_session
from orchestration.sweep.lock import sweep_lock
from orchestration.sweep.plan import SweepPlan, plan_sweep
from orchestration.sweep.report import SweepReport, write_report
from orchestration.sweep.spec import SweepSpec, load_sweep
from orchestration.sweep.tracking import SweepTracking
from orchestration.sweep.trials import TrialOutcome, TrialPaths, finished_outcome, run_trials
from pipeline.config import load_config
from pipeline.training.hooks import TrainHooks

__all__ = ["SWEEP_KIND", "SweepRequest", "load_sweep", "plan_sweep", "run_sweep"]

# What `unmask sweep --out` writes: a directory that grows in place and resumes.
SWEEP_KIND = OutputKind("sweep", "an unmask sweep", whole=False)


@dataclass(frozen=True)
class SweepRequest:
    """What ``unmask sweep`` was asked to do."""

    sweep_file: Path
    out: Path
    address: str | None = None      # a Ray cluster; None: the job's cluster, else a local Ray
    num_cpus: int | None = None     # a local Ray's CPUs; None: the machine's


def _outcomes_before(plan: SweepPlan, out: Path) -> dict[str, TrialOutcome]:
    """The trials a rerun keeps: finished, their final validation in their run directory."""
    kept = {}
    for trial in plan.trials:
        paths = TrialPaths(out, trial.name)
        outcome = TrialOutcome.read(paths.state)
        if outcome is not None and outcome.status == "finished" and finished_outcome(trial, paths) is not None:
            kept[trial.name] = outcome
    return kept


def run_sweep(request: SweepRequest, *, say: Callable[[str], None] = print,
              hooks: TrainHooks | None = None) -> SweepReport:
    """Run every trial not finished yet, then fit, plot and summarize; the report. Failed trials
    (after their retries) are in the report and its table; the caller decides the exit status."""
    spec: SweepSpec = load_sweep(request.sweep_file)
    plan = plan_sweep(spec)
    reads = [InputPath(request.sweep_file, "SWEEP.yaml"), InputPath(spec.config, f"{spec.source}: config")]
    if "://" not in plan.data:
        reads.append(InputPath(plan.data, f"{spec.source}: data"))
    claim_output_dir(request.out, SWEEP_KIND, "--out", reads)
    with sweep_lock(request.out):
        return _run(request, plan, say, hooks or TrainHooks())


def _run(request: SweepRequest, plan: SweepPlan, say: Callable[[str], None], hooks: TrainHooks) -> SweepReport:
    spec = plan.spec
    outcomes = _outcomes_before(plan, request.out)
    todo = [trial for trial in plan.trials if trial.name not in outcomes]
    say(f"unmask sweep: {len(plan.trials)} trials, {len(outcomes)} finished before, {len(todo)} to run "
        f"(data {plan.data}, sequence length {plan.seq_len})")
    tracking = SweepTracking.open(request.out, load_config(spec.config), request.out.resolve().name)
    tracking.describe({"sweep.file": str(spec.source), "sweep.budgets": ",".join(f"{b:g}" for b in spec.budgets),
                       "sweep.processes": ",".join(spec.processes), "sweep.trials": str(len(plan.trials))})

    def ended(trial, outcome: TrialOutcome) -> None:
        bound = f"bound {outcome.nelbo_per_token:.4f} nats/token" if outcome.status == "finished" else outcome.error
        say(f"unmask sweep: trial {trial.name}: {outcome.status} after {outcome.attempts} attempt(s): {bound}")
        tracking.adopt(trial, outcome, request.out)

    if todo:
        with ray_session(request.address, request.num_cpus, log_to_driver=True):
            for outcome in run_trials(todo, request.out, plan.data, cpus=spec.resources.cpus,
                                      gpus=spec.resources.gpus, max_retries=spec.max_retries, hooks=hooks,
                                      on_outcome=ended):
                outcomes[outcome.name] = outcome
    report = SweepReport(plan, outcomes)
    files = write_report(report, request.out)
    tracking.finish(report.metrics(), files, failed=bool(report.failed))
    say(f"unmask sweep: report in {request.out / 'report' / 'report.html'}, summary in {files[0]}")
    return report
