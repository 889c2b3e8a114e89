"""The report's plots, as ``Plot`` blocks of the report document (PNG bytes and a caption).

* ``plots/curves.png``: training curves (e.g. "train/loss", "val/nelbo_per_token": lists of
  (step, value) in nats per token), when any has points.
* ``plots/per_t_<dataset>.png``: for a dataset with per-time contributions, each block's
  contribution to the bound against its time t (masking rate 1 - alpha_t) and its mean per
  bin of t: where the bound comes from.

Plots use matplotlib's Agg canvas through the object-oriented API: no pyplot, no global
state, no display needed. The same data gives the same PNG bytes.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from evaluation.report_document import Plot
from evaluation.results import EvalResults, PerTimeContributions

__all__ = ["CURVES_PLOT", "PLOTS_DIR", "Curves", "report_plots"]

PLOTS_DIR = "plots"
CURVES_PLOT = "curves.png"
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


def _curves_plot(curves: Curves) -> Plot | None:
    series = {name: points for name, points in curves.items() if points}
    if not series:
        return None

    def draw(axes: Any) -> None:
        for name, points in series.items():
            steps, values = zip(*points)
            axes.plot(steps, values, label=name, linewidth=1.2,
                      marker="o" if len(points) <= SHORT_SERIES_POINTS else None, markersize=3)
        axes.set_xlabel("step")
        axes.set_ylabel("nats per token")
        axes.set_title("Training loss and validation bound")
        axes.grid(alpha=0.3)
        axes.legend()

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
    return Plot(Path(PLOTS_DIR) / f"per_t_{stem}.png", f"{name}: contribution against t", caption,
                _render_png(draw))


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
    """The plots there is data for: the training curves, then one per dataset with per_t."""
    with_per_t = {name: record.per_t for name, record in results.datasets.items()
                  if isinstance(record.per_t, PerTimeContributions)}
    stems = _per_t_stems(with_per_t)
    plots = [_curves_plot(curves)] if curves else []
    plots += [_per_t_plot(name, per_t, stems[name]) for name, per_t in with_per_t.items()]
    return [plot for plot in plots if plot is not None]
