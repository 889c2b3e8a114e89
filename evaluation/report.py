"""The report of ``unmask eval``: results.json, report.md, a self-contained report.html, plots.

    files = write_report(results, Path("eval/run1"), curves={"train/loss": [(100, 4.2), ...]})
    files.markdown, files.html, files.json, files.plots

``results`` (made by the evaluation code; every number in the report comes from it)::

    {"model": {"path": str, "objective": "diffusion" | "autoregressive", "step": int,
               "tokens_seen": int, "weights": "ema" | "model",
               "network": {"n_layers", "d_model", "n_heads", "vocab_size", "max_seq_len", ...},
               "tokenizer": {"kind", "sha256", "vocab_size", ...}},
     "protocol": {"seq_len": int, "samples_per_block": int, "seed": int,
                  "estimator": "continuous" | "discrete" | "autoregressive",
                  "discrete_steps": int | None, "target_rel_error": float | None,
                  "add_eos": bool, "wrapping": str, "precision": str, "world_size": int, ...},
     "datasets": {NAME: {"dataset": EvalDataset.protocol(),      # file, sha256, detokenizer, ...
                         "estimate": BoundEstimate.to_dict(),
                         "perplexity_bound": float, "perplexity_interval": [low, high],
                         "nelbo_per_token": float, "standard_error": float,
                         "bits_per_byte": float, "num_tokens": int,
                         "per_t": {"t": [float], "contribution": [float]}}},  # per_t optional
     "samples": [{"text": str, "network_calls": int, "steps": int}],          # may be empty
     "mlflow": {"tracking_uri": str, "run_id": str} | None,
     "created": ISO 8601 str, "unmask_version": str, "git_commit": str}

Files in ``out_dir`` (each written atomically, so a reader never sees half a file):

* ``results.json``: ``results`` verbatim (indented, sorted keys); the record to reproduce from.
* ``plots/curves.png``: the training curves given as ``curves`` (e.g. "train/loss",
  "val/nelbo_per_token": lists of (step, value) in nats per token), when any.
* ``plots/per_t_<dataset>.png``: for a dataset with ``per_t``, each block's contribution to
  the bound against its time t (masking rate 1 - alpha_t) and its mean per bin of t: where
  the bound comes from.
* ``report.md`` and ``report.html``: the same document (title, results table, protocol,
  reference numbers, samples, plots), rendered from one in-memory model of it. The HTML is
  self-contained: inline CSS, plots as base64 data URIs, every text from ``results`` escaped.

Plots use matplotlib's Agg canvas through the object-oriented API: no pyplot, no global
state, no display needed.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from common.atomic_files import atomic_write_bytes
from evaluation.references import REFERENCE_SEQ_LEN, REFERENCE_TOKENIZER, Reference, protocol_note, references_for

__all__ = ["MARKDOWN_NAME", "HTML_NAME", "JSON_NAME", "PLOTS_DIR", "ReportFiles", "write_report"]

MARKDOWN_NAME = "report.md"
HTML_NAME = "report.html"
JSON_NAME = "results.json"
PLOTS_DIR = "plots"
CURVES_PLOT = "curves.png"
PLOT_DPI = 110
PLOT_SIZE_INCHES = (7.0, 4.2)
PER_T_BINS = 20                # bins of t for the mean line of the per-t plot
SHORT_SERIES_POINTS = 50       # curves this short (validation) get markers on their points
GPT2_TOKENIZER_KIND = "gpt2-bpe"  # data_prep.tokenizer's kind of the GPT-2 byte-level BPE
AUTOREGRESSIVE = "autoregressive"
MISSING = "—"
# What `results` must hold for the report to say anything true; the rest is optional.
_REQUIRED_MODEL_KEYS = ("path", "objective", "step")
_REQUIRED_DATASET_KEYS = ("dataset", "estimate", "perplexity_bound", "perplexity_interval",
                          "nelbo_per_token", "standard_error", "bits_per_byte", "num_tokens")
# Markdown punctuation that could start emphasis, code, links or raw HTML (or end a cell). An
# underscore inside a word (d_model) cannot start emphasis: it is left as it is, for reading.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*\[\]<>|#&]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
_FILE_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 72rem;
       margin: 2rem auto; padding: 0 1rem; color: #1b1f24; line-height: 1.45; }
h1 { font-size: 1.6rem; } h2 { margin-top: 2rem; border-bottom: 1px solid #d0d7de; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #d0d7de; padding: 0.3rem 0.6rem; text-align: left;
         vertical-align: top; overflow-wrap: anywhere; }
th { background: #f6f8fa; }
code, pre { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; font-size: 0.85rem; }
blockquote { margin: 0.5rem 0 1rem; padding: 0.4rem 1rem; border-left: 4px solid #d0d7de;
             background: #f6f8fa; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; margin: 0; }
figure { margin: 1rem 0; } img { max-width: 100%; }
figcaption { font-size: 0.9rem; color: #57606a; }
"""


@dataclass(frozen=True)
class ReportFiles:
    """Where ``write_report`` put the report; ``plots`` lists only the plots it wrote."""

    markdown: Path
    html: Path
    json: Path
    plots: list[Path]


# ------------------------------------------------------------------------- the document
@dataclass(frozen=True)
class Code:
    """Inline text shown verbatim in monospace (values, paths, hashes)."""

    text: str


Inline = str | Code  # a plain str is prose: each renderer escapes it for its format


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Paragraph:
    parts: tuple[Inline, ...]


@dataclass(frozen=True)
class Table:
    header: tuple[Inline, ...]
    rows: tuple[tuple[Inline, ...], ...]


@dataclass(frozen=True)
class Quote:
    """Verbatim text (a sample), as a quoted block."""

    text: str


@dataclass(frozen=True)
class Plot:
    """A rendered plot: its path relative to the report and its PNG bytes."""

    relative_path: Path
    title: str    # short: the image's alternative text
    caption: str  # what the plot shows, in a sentence or two
    png: bytes


Block = Heading | Paragraph | Table | Quote | Plot


def _paragraph(*parts: Inline) -> Paragraph:
    return Paragraph(tuple(parts))


# ------------------------------------------------------------------------- formatting
def _number(value: float | None, digits: int) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:,.{digits}f}"


def _count(value: int | None) -> str:
    return MISSING if value is None else f"{value:,}"


def _raw(value: Any) -> str:
    """A protocol value exactly: strings as they are, anything else as JSON (null, true, 1e-05)."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _is_autoregressive(results: dict) -> bool:
    return results["model"]["objective"] == AUTOREGRESSIVE


def _safe_file_stem(name: str) -> str:
    # A generic dataset's name is its file path; keep the plot's name one plain file name.
    return _FILE_NAME_UNSAFE.sub("_", name).strip("._") or "dataset"


# ------------------------------------------------------------------------- validation
def _check_results(results: dict) -> None:
    """Refuse a results dict the report would misreport, naming what is missing."""
    missing = [key for key in ("model", "protocol", "datasets") if key not in results]
    missing += [f"model.{key}" for key in _REQUIRED_MODEL_KEYS if key not in results.get("model", {})]
    for name, record in results.get("datasets", {}).items():
        missing += [f"datasets.{name}.{key}" for key in _REQUIRED_DATASET_KEYS if key not in record]
    if missing:
        raise ValueError(f"results lack {', '.join(missing)} (see evaluation.report for the schema)")


# ------------------------------------------------------------------------- plots
def _render_png(draw: Callable[[Any], None]) -> bytes:
    """Draw on a fresh Agg figure's axes and return the PNG; the figure is then dropped."""
    # Imported here: only a report with plots needs matplotlib.
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


def _curves_plot(curves: dict[str, list[tuple[int, float]]]) -> Plot | None:
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


def _per_t_plot(name: str, per_t: dict, stem: str) -> Plot | None:
    t = np.asarray(per_t.get("t", []), dtype=np.float64)
    contribution = np.asarray(per_t.get("contribution", []), dtype=np.float64)
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


def _plots(results: dict, curves: dict[str, list[tuple[int, float]]] | None) -> list[Plot]:
    with_per_t = {name: record["per_t"] for name, record in results["datasets"].items()
                  if record.get("per_t")}
    stems = _per_t_stems(with_per_t)
    plots = [_curves_plot(curves)] if curves else []
    plots += [_per_t_plot(name, per_t, stems[name]) for name, per_t in with_per_t.items()]
    return [plot for plot in plots if plot is not None]


# ------------------------------------------------------------------------- sections
def _title(results: dict) -> str:
    model = results["model"]
    return f"Evaluation report: {model['path']} at step {model['step']:,}"


def _header_blocks(results: dict) -> list[Block]:
    model = results["model"]
    blocks: list[Block] = [
        Heading(1, _title(results)),
        _paragraph(f"Objective: {model['objective']}; weights: {model.get('weights', MISSING)}; "
                   f"tokens seen in training: {_count(model.get('tokens_seen'))}."),
        _paragraph("Created ", Code(str(results.get("created", MISSING))), " by unmask ",
                   Code(str(results.get("unmask_version", MISSING))), " at git commit ",
                   Code(str(results.get("git_commit", MISSING))), "."),
    ]
    mlflow = results.get("mlflow")
    if mlflow:
        blocks.append(_paragraph("MLflow run ", Code(str(mlflow.get("run_id", MISSING))), " at ",
                                 Code(str(mlflow.get("tracking_uri", MISSING))), "."))
    return blocks


def _results_row(name: str, record: dict, exact: bool) -> tuple[Inline, ...]:
    nelbo = _number(record["nelbo_per_token"], 4)
    perplexity = _number(record["perplexity_bound"], 2)
    if not exact:
        nelbo += f" ± {_number(record['standard_error'], 4)}"
        low, high = record["perplexity_interval"]
        perplexity += f" ({_number(low, 2)} – {_number(high, 2)})"
    return (name, _count(record["num_tokens"]), nelbo, perplexity,
            _number(record["bits_per_byte"], 4))


def _results_blocks(results: dict) -> list[Block]:
    exact = _is_autoregressive(results)
    header = (("dataset", "tokens", "NLL/token (nats)", "perplexity (exact)", "bits/byte") if exact else
              ("dataset", "tokens", "NELBO/token (nats ± SE)", "perplexity bound (95% interval)",
               "bits/byte"))
    rows = tuple(_results_row(name, record, exact) for name, record in results["datasets"].items())
    explanation = (
        "Exact negative log-likelihood per token of the causal model; perplexity = "
        "exp(NLL/token)." if exact else
        "NELBO/token: the negative evidence lower bound per token, ± its Monte Carlo standard "
        "error. The perplexity bound exp(NELBO/token) is an upper bound on the model's "
        "perplexity; its interval is the 95% Monte Carlo interval of that bound (more samples "
        "shrink the interval, not the bound).")
    return [Heading(2, "Results"), Table(header, rows),
            _paragraph(explanation, " Tokens are counted with the model's tokenizer (EOS "
                       "included); bits per byte divide the total by the UTF-8 bytes of the "
                       "detokenized text and do not depend on the tokenizer.")]


def _training_blocks(results: dict) -> list[Block]:
    """The training's own validation bound before and after training (when known)."""
    training = results.get("training")
    if not training:
        return []
    return [Heading(2, "Training"),
            _paragraph(f"Validation bound during training (EMA weights, {training['val_split']!r} split of the "
                       f"training data): {_number(training['untrained_val_nelbo_per_token'], 4)} nats/token "
                       f"at step 0 (untrained), {_number(training['final_val_nelbo_per_token'], 4)} nats/token "
                       f"at step {_count(training['final_step'])}.")]


def _flatten(mapping: dict, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _key_value_table(mapping: dict) -> Table:
    return Table(("field", "value"),
                 tuple((Code(key), Code(_raw(value))) for key, value in _flatten(mapping)))


def _by_dataset_table(records: dict[str, dict]) -> Table:
    """One row per field, one column per dataset: every field of every record, verbatim."""
    fields = list(dict.fromkeys(key for record in records.values() for key, _ in _flatten(record)))
    flat = {name: dict(_flatten(record)) for name, record in records.items()}
    rows = tuple((Code(field), *(Code(_raw(flat[name][field])) if field in flat[name] else MISSING
                                 for name in records))
                 for field in fields)
    return Table(("field", *records), rows)


def _protocol_blocks(results: dict) -> list[Block]:
    datasets = results["datasets"]
    return [
        Heading(2, "Protocol"),
        _paragraph("Every field needed to reproduce the numbers above, verbatim."),
        Heading(3, "Evaluation"), _key_value_table(results["protocol"]),
        Heading(3, "Model"), _key_value_table(results["model"]),
        Heading(3, "Dataset files"),
        _by_dataset_table({name: record["dataset"] for name, record in datasets.items()}),
        Heading(3, "Estimates"),
        _by_dataset_table({name: record["estimate"] for name, record in datasets.items()}),
    ]


def _our_scale(network: dict) -> str:
    if not network:
        return MISSING
    return (f"{network.get('n_layers', '?')} layers, d_model {network.get('d_model', '?')}, "
            f"{network.get('n_heads', '?')} heads")


def _our_reference_row(results: dict, record: dict) -> tuple[Inline, ...]:
    model = results["model"]
    tokenizer = model.get("tokenizer", {})
    exact = _is_autoregressive(results)
    value = f"{'' if exact else '≤ '}{_number(record['perplexity_bound'], 2)}"
    return (f"this run ({model['objective']}, step {model['step']:,})", value,
            _our_scale(model.get("network", {})),
            f"{tokenizer.get('kind', MISSING)} (vocab {_count(tokenizer.get('vocab_size'))})",
            str(model.get("training_data", MISSING)), "this report")


def _reference_row(reference: Reference) -> tuple[Inline, ...]:
    model = f"{reference.model} ({reference.note})" if reference.note else reference.model
    return (model, reference.display_value, reference.scale, reference.tokenizer,
            reference.training_data, reference.source)


def _comparability_caveats(results: dict) -> list[str]:
    """Why this run's numbers may not be comparable with the references at all."""
    protocol = results["protocol"]
    caveats = []
    kind = results["model"].get("tokenizer", {}).get("kind")
    if kind != GPT2_TOKENIZER_KIND:
        caveats.append(f"This run's tokenizer ({kind or 'not recorded'}) is not {REFERENCE_TOKENIZER}: "
                       f"per-token perplexities are NOT comparable with the references.")
    if protocol.get("seq_len") != REFERENCE_SEQ_LEN:
        caveats.append(f"This run's sequence length is {protocol.get('seq_len')}, the references' "
                       f"{REFERENCE_SEQ_LEN}.")
    if protocol.get("split", "test") != "test" or protocol.get("max_documents") is not None:
        caveats.append("This run did not score the whole test split (see split and max_documents "
                       "in the protocol); the references did.")
    return caveats


def _reference_blocks(results: dict) -> list[Block]:
    blocks: list[Block] = [
        Heading(2, "Reference numbers"),
        _paragraph(f"Published perplexities, for orientation. Numbers are only comparable at the "
                   f"same tokenizer and the same evaluation protocol: every reference below uses "
                   f"the {REFERENCE_TOKENIZER} tokenizer at sequence length {REFERENCE_SEQ_LEN}, "
                   f"and the protocol alone (split, BOS/EOS handling, detokenizer, wrapping) moves "
                   f"these numbers by 5 to 15 percent across papers. ≤ marks an upper bound (a "
                   f"diffusion model's NELBO); other values are exact perplexities."),
        *(_paragraph(caveat) for caveat in _comparability_caveats(results)),
    ]
    compared = [(name, record, references_for(name)) for name, record in results["datasets"].items()]
    compared = [entry for entry in compared if entry[2]]
    if not compared:
        blocks.append(_paragraph("No published reference numbers for these datasets."))
    header = ("model", "perplexity", "scale", "tokenizer", "training data", "source")
    for name, record, references in compared:
        blocks.append(Heading(3, name))
        note = protocol_note(name)
        if note:
            blocks.append(_paragraph(f"Protocol difference: {note}."))
        rows = (_our_reference_row(results, record), *map(_reference_row, references))
        blocks.append(Table(header, rows))
    return blocks


def _sample_blocks(results: dict) -> list[Block]:
    samples = results.get("samples") or []
    if not samples:
        return []
    blocks: list[Block] = [Heading(2, "Samples")]
    for number, sample in enumerate(samples, start=1):
        blocks.append(_paragraph(f"Sample {number}: {_count(sample.get('steps'))} steps, "
                                 f"{_count(sample.get('network_calls'))} network calls."))
        blocks.append(Quote(sample["text"]))
    return blocks


def _comparison_blocks(results: dict) -> list[Block]:
    """This model next to another evaluation of the same data (``unmask eval --compare``):
    the diffusion-vs-AR gap on the same tokens when both share the tokenizer."""
    other = results.get("comparison")
    if not other:
        return []
    ours, theirs = results["model"], other["model"]
    same_tokenizer = ours["tokenizer"]["sha256"] == theirs["tokenizer"]["sha256"]
    header = ("dataset", f"this model ({ours['objective']})", f"{theirs['objective']}: {theirs['path']}",
              "gap (nats/token)", "gap (bits/byte)")
    rows = []
    for name, record in results["datasets"].items():
        if name in other["datasets"]:
            theirs_record = other["datasets"][name]
            rows.append((name, _number(record["perplexity_bound"], 2), _number(theirs_record["perplexity_bound"], 2),
                         _number(record["nelbo_per_token"] - theirs_record["nelbo_per_token"], 4),
                         _number(record["bits_per_byte"] - theirs_record["bits_per_byte"], 4)))
    note = ("Both models share the tokenizer, so the per-token gap compares the same tokens."
            if same_tokenizer else "The tokenizers differ: only the bits-per-byte gap is comparable.")
    return [Heading(2, "Comparison"), Table(header, tuple(rows)),
            _paragraph("Perplexities (a bound for a diffusion model, exact for an autoregressive one); "
                       "a positive gap means this model's number is higher. ", note)]


def _plot_blocks(plots: list[Plot]) -> list[Block]:
    return [Heading(2, "Plots"), *plots] if plots else []


def _document(results: dict, plots: list[Plot]) -> list[Block]:
    return [*_header_blocks(results), *_results_blocks(results), *_training_blocks(results),
            *_comparison_blocks(results),
            *_reference_blocks(results),
            *_sample_blocks(results), *_plot_blocks(plots), *_protocol_blocks(results)]


# ------------------------------------------------------------------------- Markdown
def _md_text(text: str) -> str:
    # Prose stays on its line (a newline would end a table row or a paragraph).
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text.replace("\n", " "))


def _md_code(text: str) -> str:
    text = text.replace("\n", " ")
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    # A span that starts or ends with a backtick needs a space between it and the fence.
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _md_inline(part: Inline) -> str:
    return _md_code(part.text) if isinstance(part, Code) else _md_text(part)


def _md_cell(part: Inline) -> str:
    # GFM splits cells at every unescaped "|", even inside a code span.
    return _md_inline(part).replace("|", r"\|") if isinstance(part, Code) else _md_inline(part)


def _md_table(table: Table) -> str:
    def row(cells: Iterable[Inline]) -> str:
        return "| " + " | ".join(_md_cell(cell) for cell in cells) + " |"

    lines = [row(table.header), "|" + "---|" * len(table.header), *map(row, table.rows)]
    return "\n".join(lines)


def _md_quote(text: str) -> str:
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    body = "\n".join(f"> {line}" if line else ">" for line in text.split("\n"))
    return f"> {fence}text\n{body}\n> {fence}"


def _md_block(block: Block) -> str:
    if isinstance(block, Heading):
        return f"{'#' * block.level} {_md_text(block.text)}"
    if isinstance(block, Paragraph):
        return "".join(map(_md_inline, block.parts))
    if isinstance(block, Table):
        return _md_table(block)
    if isinstance(block, Quote):
        return _md_quote(block.text)
    return f"![{_md_text(block.title)}]({block.relative_path.as_posix()})\n\n{_md_text(block.caption)}"


def _render_markdown(document: list[Block]) -> str:
    """The document as GitHub-flavoured Markdown; plots linked by relative path."""
    return "\n\n".join(map(_md_block, document)) + "\n"


# ------------------------------------------------------------------------- HTML
def _html_inline(part: Inline) -> str:
    if isinstance(part, Code):
        return f"<code>{html.escape(part.text)}</code>"
    return html.escape(part)


def _html_table(table: Table) -> str:
    head = "".join(f"<th>{_html_inline(cell)}</th>" for cell in table.header)
    body = "".join("<tr>" + "".join(f"<td>{_html_inline(cell)}</td>" for cell in row) + "</tr>\n"
                   for row in table.rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


def _html_plot(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(plot.title)}">'
            f"<figcaption>{html.escape(plot.caption)}</figcaption></figure>")


def _html_block(block: Block) -> str:
    if isinstance(block, Heading):
        return f"<h{block.level}>{html.escape(block.text)}</h{block.level}>"
    if isinstance(block, Paragraph):
        return f"<p>{''.join(map(_html_inline, block.parts))}</p>"
    if isinstance(block, Table):
        return _html_table(block)
    if isinstance(block, Quote):
        return f"<blockquote><pre>{html.escape(block.text)}</pre></blockquote>"
    return _html_plot(block)


def _render_html(document: list[Block], title: str) -> str:
    """The document as one self-contained HTML page: inline CSS, plots as data URIs."""
    body = "\n".join(map(_html_block, document))
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n"
            f"<body>\n{body}\n</body>\n</html>\n")


# ------------------------------------------------------------------------- writing
def _results_json(results: dict) -> bytes:
    return (json.dumps(results, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def write_report(results: dict, out_dir: Path, *,
                 curves: dict[str, list[tuple[int, float]]] | None = None) -> ReportFiles:
    """Write results.json, the plots, report.md and report.html into ``out_dir``.

    ``results`` follows the schema of this module's docstring; ``curves`` maps a metric name
    to its (step, value) points. Everything is rendered before the first file is written, so
    a malformed ``results`` (ValueError) leaves ``out_dir`` as it was.
    """
    out_dir = Path(out_dir)
    _check_results(results)
    plots = _plots(results, curves)
    document = _document(results, plots)
    # Plots first: a reader of a fresh report.md finds the images it links.
    contents = {
        **{out_dir / plot.relative_path: plot.png for plot in plots},
        out_dir / JSON_NAME: _results_json(results),
        out_dir / MARKDOWN_NAME: _render_markdown(document).encode("utf-8"),
        out_dir / HTML_NAME: _render_html(document, _title(results)).encode("utf-8"),
    }
    for path, data in contents.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
    return ReportFiles(out_dir / MARKDOWN_NAME, out_dir / HTML_NAME, out_dir / JSON_NAME,
                       [out_dir / plot.relative_path for plot in plots])
