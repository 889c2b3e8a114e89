"""A sweep's report: the summary (JSON and a Markdown table), the fits, the plots and an HTML page.

``SWEEP/summary.json`` holds every point (its budget, size, parameters, steps, status, attempts and
final bound), the fits of each process (``evaluation.scaling_laws``) and the compute multipliers
against the reference process; ``SWEEP/report/`` holds ``summary.md``, ``isoflop.png`` (bound
against parameters at each budget, one panel per process, with the parabolas and their minima),
``laws.png`` (N_opt(C) and L_opt(C) with their power laws) and ``report.html``. Plots use
matplotlib's Agg canvas (no display). The manual: docs/scaling.md#the-report.
"""

from __future__ import annotations

import html
import io
import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np

from common.atomic_files import atomic_write_bytes
from evaluation.scaling_laws import ComputeMultiplier, compute_multiplier, fit_process
from orchestration.sweep.plan import SweepPlan, budget_name
from orchestration.sweep.trials import TrialOutcome

__all__ = ["ISOFLOP_PLOT", "LAWS_PLOT", "SweepReport", "write_report"]

ISOFLOP_PLOT, LAWS_PLOT, HTML_PAGE, TABLE, SUMMARY = "isoflop.png", "laws.png", "report.html", "summary.md", "summary.json"
PLOT_DPI = 110
PANEL_INCHES = 4.2


class SweepReport:
    """The summary of a sweep's outcomes and its fits, and the files written from it."""

    def __init__(self, plan: SweepPlan, outcomes: dict[str, TrialOutcome]) -> None:
        self.plan, self.outcomes = plan, outcomes
        self.fits = {process: fit_process(self.points(process)) for process in plan.spec.processes}
        self.multipliers = self._multipliers()

    def points(self, process: str) -> list[tuple[float, float, float]]:
        """(budget, parameters, bound) of the process's finished trials."""
        return [(t.budget, float(t.parameters), self.outcomes[t.name].nelbo_per_token)
                for t in self.plan.trials if t.process == process and t.name in self.outcomes
                and self.outcomes[t.name].status == "finished"]

    def _multipliers(self) -> dict[str, list[ComputeMultiplier]]:
        """Each process against the reference, at the reference's L_opt of each budget it fitted."""
        reference = self.plan.spec.reference
        ref_fit = self.fits.get(reference) if reference else None
        if ref_fit is None or ref_fit.loss_opt is None:
            return {}
        return {process: [compute_multiplier(ref_fit.loss_opt, fit.loss_opt, m.loss_opt) for m in ref_fit.minima]
                for process, fit in self.fits.items() if process != reference and fit.loss_opt is not None}

    @property
    def failed(self) -> list[str]:
        return [name for name, outcome in self.outcomes.items() if outcome.status == "failed"]

    def to_json(self) -> dict:
        trials = [{**t.record(), **({k: v for k, v in asdict(self.outcomes[t.name]).items() if k != "name"}
                                    if t.name in self.outcomes else {"status": "not run"})}
                  for t in self.plan.trials]
        return {"sweep": self.plan.spec.source, "data": self.plan.data, "seq_len": self.plan.seq_len,
                "train_tokens": self.plan.train_tokens, "reference": self.plan.spec.reference,
                "trials": trials, "failed": self.failed,
                "fits": {process: fit.to_json() for process, fit in self.fits.items()},
                "multipliers": {p: [asdict(m) for m in ms] for p, ms in self.multipliers.items()}}

    def metrics(self) -> dict[str, float]:
        """The fits as MLflow metrics of the parent run."""
        metrics = {}
        for process, fit in self.fits.items():
            for key, law in (("n_opt", fit.n_opt), ("loss_opt", fit.loss_opt)):
                if law is not None:
                    metrics[f"fit/{process}/{key}_exponent"] = law.exponent
        for process, values in self.multipliers.items():
            if values and values[-1].multiplier is not None and math.isfinite(values[-1].multiplier):
                metrics[f"fit/{process}/compute_multiplier"] = values[-1].multiplier
        return metrics


def _interval(law_interval: tuple[float, float] | None) -> str:
    return f" [{law_interval[0]:.3f}, {law_interval[1]:.3f}]" if law_interval else ""


def _times(multiplier: float | None) -> str:
    return "- (a law that does not fall)" if multiplier is None else f"{multiplier:.3g}x"


def _table(report: SweepReport) -> str:
    rows = ["| trial | process | budget (FLOPs) | size | parameters | steps | status | attempts | bound (nats/token) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for t in report.plan.trials:
        o = report.outcomes.get(t.name)
        bound = f"{o.nelbo_per_token:.4f}" if o and o.nelbo_per_token is not None else "-"
        status = (o.status if o else "not run") + (f": {o.error}" if o and o.error else "")
        rows.append(f"| {t.name} | {t.process} | {budget_name(t.budget)} | {t.shape.name} | {t.parameters:,} | "
                    f"{t.steps} | {status} | {o.attempts if o else 0} | {bound} |")
    fits = ["| process | minima | N_opt exponent (95%) | L_opt exponent (95%) | compute multiplier vs reference |",
            "|---|---|---|---|---|"]
    for process, fit in report.fits.items():
        n_law, l_law = fit.n_opt, fit.loss_opt
        multipliers = report.multipliers.get(process) or []
        multiplier = ", ".join(f"{_times(m.multiplier)} at {m.loss:.3f}" for m in multipliers) or "-"
        inside = sum(m.interior for m in fit.minima)
        fits.append(f"| {process} | {len(fit.minima)} ({inside} inside the sizes) | "
                    f"{f'{n_law.exponent:.3f}' + _interval(n_law.exponent_interval) if n_law else '-'} | "
                    f"{f'{l_law.exponent:.4f}' + _interval(l_law.exponent_interval) if l_law else '-'} | "
                    f"{multiplier} |")
    return "\n".join(["# Sweep summary", "", *rows, "", "## Fits", "", *fits, ""])


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=PLOT_DPI, metadata={"Software": None})
    return buffer.getvalue()


def _isoflop_plot(report: SweepReport) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    processes = list(report.fits)
    figure = Figure(figsize=(PANEL_INCHES * len(processes), PANEL_INCHES), layout="constrained")
    FigureCanvasAgg(figure)
    axes = np.atleast_1d(figure.subplots(1, len(processes), sharey=True))
    colors = {b: f"C{i}" for i, b in enumerate(report.plan.spec.budgets)}
    for axis, process in zip(axes, processes):
        points = report.points(process)
        for budget, color in colors.items():
            curve = sorted((n, loss) for c, n, loss in points if c == budget)
            if curve:
                axis.plot(*zip(*curve), "o", color=color, label=f"C = {budget_name(budget)}")
        for minimum in report.fits[process].minima:
            n = [n for c, n, _ in points if c == minimum.budget]
            grid = np.exp(np.linspace(math.log(min(n)), math.log(max(n)), 50))
            axis.plot(grid, np.polyval(minimum.coefficients, np.log(grid)), "-", color=colors[minimum.budget])
            axis.plot([minimum.n_opt], [minimum.loss_opt], "*", color=colors[minimum.budget], markersize=12)
        if axis.has_data():   # a process without a finished trial leaves its panel empty
            axis.set_xscale("log")
        axis.set_title(process)
        axis.set_xlabel("parameters N")
    axes[0].set_ylabel("final validation bound (nats / token)")
    if axes[0].has_data():
        axes[0].legend(fontsize="small")
    return _png(figure)


def _laws_plot(report: SweepReport) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(2 * PANEL_INCHES, PANEL_INCHES), layout="constrained")
    FigureCanvasAgg(figure)
    n_axis, loss_axis = figure.subplots(1, 2)
    budgets = np.array(report.plan.spec.budgets)
    grid = np.exp(np.linspace(math.log(budgets.min()), math.log(budgets.max()), 50))
    for index, (process, fit) in enumerate(report.fits.items()):
        color = f"C{index}"
        if not fit.minima:
            continue
        c = [m.budget for m in fit.minima]
        n_axis.plot(c, [m.n_opt for m in fit.minima], "o", color=color, label=process)
        loss_axis.plot(c, [m.loss_opt for m in fit.minima], "o", color=color, label=process)
        if fit.n_opt is not None:
            n_axis.plot(grid, fit.n_opt(grid), "-", color=color)
            loss_axis.plot(grid, fit.loss_opt(grid), "-", color=color)
    for axis, label in ((n_axis, "N_opt"), (loss_axis, "L_opt (nats / token)")):
        if axis.has_data():   # no minimum yet: fewer than three finished sizes at every budget
            axis.set_xscale("log")
            axis.set_yscale("log")
        axis.set_xlabel("training FLOPs C")
        axis.set_ylabel(label)
    if n_axis.has_data():
        n_axis.legend(fontsize="small")
    return _png(figure)


def _html(report: SweepReport, table: str) -> str:
    def cells(line: str, tag: str) -> str:
        return "<tr>" + "".join(f"<{tag}>{html.escape(c.strip())}</{tag}>" for c in line.strip("|").split("|")) + "</tr>"

    body, rows = [], []
    for line in [*table.splitlines(), ""]:   # the blank line ends the last table
        if line.startswith("|---"):
            continue
        if line.startswith("|"):
            rows.append(cells(line, "th" if not rows else "td"))
            continue
        if rows:
            body.append("<table>" + "".join(rows) + "</table>")
            rows = []
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line.lstrip('# '))}</h{level}>")
    images = "".join(f'<p><img src="{name}" alt="{name}"></p>' for name in (ISOFLOP_PLOT, LAWS_PLOT))
    style = "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;font:13px sans-serif}"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Sweep {html.escape(report.plan.spec.source)}"
            f"</title><style>{style}</style></head><body>{body[0]}{images}{''.join(body[1:])}</body></html>\n")


def write_report(report: SweepReport, sweep_dir: Path) -> list[Path]:
    """Write the summary, the table, the plots and the page; the files written."""
    out = sweep_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    table = _table(report)
    files = {sweep_dir / SUMMARY: (json.dumps(report.to_json(), indent=2) + "\n").encode(),
             out / TABLE: table.encode(), out / ISOFLOP_PLOT: _isoflop_plot(report),
             out / LAWS_PLOT: _laws_plot(report), out / HTML_PAGE: _html(report, table).encode()}
    for path, data in files.items():
        atomic_write_bytes(path, data)
    return list(files)
