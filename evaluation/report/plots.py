"""The report's plots, as ``Plot`` blocks of the report document (PNG bytes and a caption).

* ``plots/curves.png``: training curves (e.g. "train/loss", "val/nelbo_per_token": lists of
  (step, value) in nats per token), when any has points.
* ``plots/per_t_<dataset>.png``: for a dataset with per-time contributions, each block's
  contribution to the bound against its time t (masking rate 1 - alpha_t) and its mean per
  bin of t: where the bound comes from.
* ``plots/sampler_sweep.png``: with a sampler sweep, the samples' generative perplexity (or,
  without a reference model, their unigram entropy) against the network calls they needed,
  one line per sampler.

Plots use matplotlib's Agg canvas through the object-oriented API: no pyplot, no global
state, no display needed. The same data gives the same PNG bytes.
See docs/evaluation.md#the-report.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from evaluation.report.document import Plot
from evaluation.results import EvalResults, PerTimeContributions, SweepRow

__all__ = ["CURVES_PLOT", "PLOTS_DIR", "SWEEP_PLOT", "Curves", "report_plots"]

PLOTS_DIR = "plots"
CURVES_PLOT = "curves.png"
SWEEP_PLOT = "sampler_sweep.png"
PER_T_PREFIX = "per_t_"
PLOT_DPI = 110
PLOT_SIZE_INCHES = (7.0, 4.2)
PER_T_BINS = 20                # bins of t for the mean line of the per-t plot
SHORT_SERIES_POINTS = 50       # curves this short (validation) get markers on their points
_FILE_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")

Curves = dict[str, list[tuple[int, float]]]  # metric name -> (step, value) points


def _render_png(draw: Callable[[Any], None]) -> bytes:
    """Draw on a fresh Agg figure's axes and return the PNG; the figure is then dropped."""
    # Imported here: only a report with plots needs matplotlib, which is slow to import.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=PLOT_SIZE_INCHES, dpi=PLOT_DPI)
    FigureCanvasAgg(figure)
    draw(figure.add_subplot())
    figure.tight_layout()
    buffer = io.BytesIO()
    # No "Software" metadata: the same data gives the same bytes across matplotlib versions.
    figure.savefig(buffer, format="png", dpi=PLOT_DPI, metadata={"Software": None})
    figure.clear()
    return buffer.getvalue()


def _draw_lines(axes: Any, series: dict[str, tuple[Iterable[float], Iterable[float]]], *, xlabel: str, ylabel: str,
                title: str, markers: Callable[[int], bool], log2_x: bool = False) -> None:
    """One labelled line per series (name -> (x, y)), markers on the short ones."""
    for name, (x, y) in series.items():
        x, y = list(x), list(y)
        axes.plot(x, y, label=name, linewidth=1.2, marker="o" if markers(len(x)) else None, markersize=3)
    if log2_x:
        axes.set_xscale("log", base=2)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()


def _curves_plot(curves: Curves) -> Plot | None:
    series = {name: tuple(zip(*points)) for name, points in curves.items() if points}
    if not series:
        return None

    def draw(axes: Any) -> None:
        _draw_lines(axes, series, xlabel="step", ylabel="nats per token", title="Training loss and validation bound",
                    markers=lambda count: count <= SHORT_SERIES_POINTS)

    caption = (f"Training curves ({', '.join(series)}) against the optimizer step. The "
               f"validation bound is an upper bound on the validation NLL per token.")
    return Plot(Path(PLOTS_DIR) / CURVES_PLOT, "training curves", caption, _render_png(draw))


def _binned_means(t: np.ndarray, values: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Centres of the non-empty equal-width bins of [0, 1] and the mean value in each."""
    index = np.clip((t * bins).astype(np.int64), 0, bins - 1)
    counts = np.bincount(index, minlength=bins)
    sums = np.bincount(index, weights=values, minlength=bins)
    filled = counts > 0
    centres = (np.arange(bins) + 0.5) / bins
    return centres[filled], sums[filled] / counts[filled]


def _per_t_plot(name: str, per_t: PerTimeContributions, stem: str) -> Plot | None:
    t = np.asarray(per_t.t, dtype=np.float64)
    contribution = np.asarray(per_t.contribution, dtype=np.float64)
    if t.shape != contribution.shape:
        raise ValueError(f"per_t of {name!r}: {t.size} times but {contribution.size} contributions")
    if t.size == 0:
        return None
    centres, means = _binned_means(t, contribution, PER_T_BINS)

    def draw(axes: Any) -> None:
        axes.scatter(t, contribution, s=6, alpha=0.35, label="one block at its time t")
        axes.plot(centres, means, color="C3", linewidth=2, label=f"mean per bin ({PER_T_BINS} bins)")
        axes.axhline(float(contribution.mean()), color="C2", linestyle="--", linewidth=1,
                     label="mean over t")
        axes.set_xlim(0.0, 1.0)
        axes.set_xlabel("t")
        axes.set_ylabel("contribution (nats per token)")
        axes.set_title(f"{name}: where the bound comes from")
        axes.grid(alpha=0.3)
        axes.legend()

    caption = (f"{name}: each block's contribution to the bound (its weighted masked "
               f"cross-entropy per token) against its time t, the masking rate 1 - alpha_t "
               f"({t.size} blocks); the line is the mean per bin of t. Over these blocks, the "
               f"mean over t (dashed) estimates the diffusion term of the bound.")
    return Plot(Path(PLOTS_DIR) / f"{PER_T_PREFIX}{stem}.png", f"{name}: contribution against t", caption,
                _render_png(draw))


def _sweep_plot(rows: tuple[SweepRow, ...]) -> Plot:
    scored = all(row.generative_perplexity is not None for row in rows)
    label = "generative perplexity" if scored else "mean unigram entropy (nats)"

    def value(row: SweepRow) -> float:
        return row.generative_perplexity if scored else row.mean_unigram_entropy

    series = {sampler: tuple(zip(*sorted((row.network_calls, value(row)) for row in rows if row.sampler == sampler)))
              for sampler in dict.fromkeys(row.sampler for row in rows)}

    def draw(axes: Any) -> None:
        _draw_lines(axes, series, xlabel="network calls per sample", ylabel=label,
                    title="Sample quality per network call", markers=lambda count: True, log2_x=True)

    caption = (f"The samples' {label} against the network calls a sample needed, per sampler, at the budgets of "
               f"the sweep; read the perplexity next to the entropy in the table.")
    return Plot(Path(PLOTS_DIR) / SWEEP_PLOT, "sample quality per network call", caption, _render_png(draw))


def _safe_file_stem(name: str) -> str:
    # A generic dataset's name is its file path; keep the plot's name one plain file name.
    return _FILE_NAME_UNSAFE.sub("_", name).strip("._") or "dataset"


def _per_t_stems(names: Iterable[str]) -> dict[str, str]:
    """A distinct file stem per dataset name (two file paths may sanitize alike)."""
    stems: dict[str, str] = {}
    for name in names:
        stem = base = _safe_file_stem(name)
        suffix = 2
        while stem in stems.values():
            stem, suffix = f"{base}_{suffix}", suffix + 1
        stems[name] = stem
    return stems


def report_plots(results: EvalResults, curves: Curves | None) -> list[Plot]:
    """The plots there is data for: the training curves, one per dataset with per_t, the sweep."""
    with_per_t = {name: record.per_t for name, record in results.datasets.items()
                  if isinstance(record.per_t, PerTimeContributions)}
    stems = _per_t_stems(with_per_t)
    plots = [_curves_plot(curves)] if curves else []
    plots += [_per_t_plot(name, per_t, stems[name]) for name, per_t in with_per_t.items()]
    if results.sampling and results.sampling.sweep:
        plots.append(_sweep_plot(results.sampling.sweep))
    return [plot for plot in plots if plot is not None]
