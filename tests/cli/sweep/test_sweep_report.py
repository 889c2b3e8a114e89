"""The sweep's report on bounds drawn from known laws: the fits, multipliers, plots, summary and page."""

from __future__ import annotations

import json
import math

import pytest

from orchestration.sweep import load_sweep, plan_sweep
from orchestration.sweep.report import SweepReport, write_report
from orchestration.sweep.trials import TrialOutcome

N_EXPONENT, LOSS_EXPONENT, MULTIPLIER = 0.5, -0.05, 16.0


def _bound(budget: float, parameters: float, center: float, compute_scale: float) -> float:
    """An isoFLOP parabola in ln N around N_opt = center (C / 4e9)^0.5, floor 20 C^-0.05, for a
    process that needs ``compute_scale`` times the compute."""
    effective = budget / compute_scale
    n_opt = center * (effective / 4e9) ** N_EXPONENT
    return 20 * effective ** LOSS_EXPONENT + 0.05 * (math.log(parameters) - math.log(n_opt)) ** 2


@pytest.fixture
def report(sweep_file):
    spec = load_sweep(sweep_file(budgets=[4e9, 8e9, 1.6e10], sizes=[{"d_model": d} for d in (32, 48, 64, 96)],
                                 processes={"ar": {"model.objective": "autoregressive"}, "mdlm": {}},
                                 reference="ar", min_steps=1))
    plan = plan_sweep(spec)
    sizes = sorted({t.parameters for t in plan.trials})
    center = math.sqrt(sizes[0] * sizes[-1])
    outcomes = {t.name: TrialOutcome(t.name, "finished", 1, t.steps,
                                     _bound(t.budget, t.parameters, center, MULTIPLIER if t.process == "mdlm" else 1))
                for t in plan.trials}
    failed = plan.trials[0].name
    outcomes[failed] = TrialOutcome(failed, "failed", 2, 3, error="RuntimeError: diverged")
    return SweepReport(plan, outcomes)


def test_the_report_fits_the_laws_of_the_bounds(report):
    mdlm = report.fits["mdlm"]
    assert len(mdlm.minima) == 3 and all(m.interior for m in report.fits["ar"].minima)
    assert mdlm.n_opt.exponent == pytest.approx(N_EXPONENT, abs=1e-6)
    assert mdlm.loss_opt.exponent == pytest.approx(LOSS_EXPONENT, abs=1e-6)
    # ar lost one point of its smallest budget: three sizes still make its parabola
    assert len(report.fits["ar"].minima) == 3
    multipliers = report.multipliers["mdlm"]
    assert [m.multiplier for m in multipliers] == pytest.approx([MULTIPLIER] * 3, rel=1e-4)
    assert report.failed == [report.plan.trials[0].name]
    assert report.metrics()["fit/mdlm/compute_multiplier"] == pytest.approx(MULTIPLIER, rel=1e-4)


def test_the_report_writes_summary_table_plots_and_page(report, tmp_path):
    files = write_report(report, tmp_path)
    names = {path.name for path in files}
    assert names == {"summary.json", "summary.md", "isoflop.png", "laws.png", "report.html"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    failed = summary["trials"][0]
    assert (failed["status"], failed["attempts"], failed["error"]) == ("failed", 2, "RuntimeError: diverged")
    assert summary["fits"]["mdlm"]["n_opt"]["exponent"] == pytest.approx(N_EXPONENT, abs=1e-6)
    assert summary["multipliers"]["mdlm"][0]["multiplier"] == pytest.approx(MULTIPLIER, rel=1e-4)
    for plot in ("isoflop.png", "laws.png"):
        assert (tmp_path / "report" / plot).read_bytes().startswith(b"\x89PNG")
    page = (tmp_path / "report" / "report.html").read_text()
    assert '<img src="isoflop.png"' in page and "RuntimeError: diverged" in page and "16x" in page
    table = (tmp_path / "report" / "summary.md").read_text()
    assert "| ar | 3 (3 inside the sizes) | 0.500 [" in table
    write_report(report, tmp_path / "again")
    assert (tmp_path / "again" / "report" / "laws.png").read_bytes() == (tmp_path / "report" / "laws.png").read_bytes()


def test_a_sweep_without_a_curve_yet_still_writes_its_report(sweep_file, tmp_path):
    """One size and a process whose every trial failed: no parabola, no law, the table and
    empty plots all the same (a sweep reports whatever it has)."""
    plan = plan_sweep(load_sweep(sweep_file(processes={"ar": {"model.objective": "autoregressive"}, "mdlm": {}},
                                            reference="ar")))
    ar, mdlm = plan.trials
    report = SweepReport(plan, {ar.name: TrialOutcome(ar.name, "finished", 1, ar.steps, 4.5),
                                mdlm.name: TrialOutcome(mdlm.name, "failed", 2, error="UserError: diverged")})
    assert report.fits["ar"].n_opt is None and report.multipliers == {} and report.failed == [mdlm.name]
    write_report(report, tmp_path)
    assert (tmp_path / "report" / "laws.png").read_bytes().startswith(b"\x89PNG")
    assert "| ar | 0 (0 inside the sizes) | - | - | - |" in (tmp_path / "report" / "summary.md").read_text()


def test_a_finished_trial_is_kept_only_on_its_own_config(micro_run, tmp_path):
    """A rerun keeps a trial whose run reached its steps with its final bound on the trial's
    config; one whose sweep file changed it (a resume field, or the bound's batches) runs again."""
    import shutil
    from dataclasses import replace

    from orchestration.sweep.plan import Shape, Trial
    from orchestration.sweep.trials import TrialPaths, finished_outcome
    from pipeline.config import load_config

    paths = TrialPaths(tmp_path, "mdlm-C1e9-d64-l2")
    shutil.copytree(micro_run, paths.run_dir)
    config = load_config(paths.run_dir / "config.json")
    trial = Trial(paths.name, "mdlm", 1e9, Shape("d64-l2", 2, 64, 2), 1, 1.0, 512, 2, config)
    kept = finished_outcome(trial, paths)
    assert kept.status == "finished" and kept.step == 2 and kept.nelbo_per_token > 0
    for changed in (replace(config, optim=replace(config.optim, lr=config.optim.lr / 2)),
                    replace(config, eval=replace(config.eval, batches=(config.eval.batches or 0) + 1))):
        assert finished_outcome(replace(trial, config=changed), paths) is None
    assert finished_outcome(replace(trial, steps=3), paths) is None   # a larger budget: more steps to go
