"""The report of ``unmask eval``: results.json, report.md, a self-contained report.html, plots.

    files = write_report(results, Path("eval/run1"), curves={"train/loss": [(100, 4.2), ...]})
    files.markdown, files.html, files.json, files.plots

``results`` is an ``EvalResults`` or its JSON object (checked whole first), and every number in
the report comes from it. Everything is rendered before the first file is written, and the
directory appears whole, replacing only an earlier report (``REPORT_KIND``,
``common.outputs``): malformed results or a failed write leave it as it was. It keeps the
``KEPT_FILES`` other steps write there (MLflow's record, ``unmask lm-eval``'s records, whose
"Downstream tasks" section it shows; with ``results=None`` that section alone). The documents
are built here from their sections and rendered by ``evaluation.report.document``. What the
directory holds: docs/evaluation.md#the-report.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from common.atomic_files import atomic_write_bytes
from common.outputs import OutputKind, holds_only, json_object, new_output_dir
from evaluation.bounds.protocols import UNMASK
from evaluation.report.document import (
    Block,
    Code,
    Heading,
    Inline,
    Plot,
    Quote,
    Table,
    paragraph,
    render_html,
    render_markdown,
)
from evaluation.report.plots import Curves, report_plots
from evaluation.report.zero_shot_table import zero_shot_blocks
from evaluation.results import (
    ABSENT,
    DOWNSTREAM_JSON,
    LM_EVAL_JSON,
    DatasetResult,
    DownstreamResults,
    EvalResults,
    ModelRecord,
    SampleRecord,
    SamplingRecord,
    ScheduleToken,
    TaskResult,
)
from pipeline.run_dir.layout import MLFLOW_RECORD

__all__ = ["HTML_NAME", "JSON_NAME", "KEPT_FILES", "MARKDOWN_NAME", "REPORT_KIND", "ReportFiles", "read_record",
           "write_report"]

log = logging.getLogger("unmask.eval")
Record = TypeVar("Record")

MARKDOWN_NAME = "report.md"
HTML_NAME = "report.html"
JSON_NAME = "results.json"
AUTOREGRESSIVE = "autoregressive"
MISSING = "—"


# Files that other steps write into a report directory (the MLflow record of a report's own run,
# written when tracking starts; `unmask lm-eval`'s records): a rewritten report keeps them.
KEPT_FILES = (MLFLOW_RECORD, DOWNSTREAM_JSON, LM_EVAL_JSON)


def _is_unmarked_report(directory: Path) -> bool:
    """A report directory that its evaluation's tracking wrote into before the report (the
    MLflow record of a report's own run): nothing but ``KEPT_FILES``, with that record among
    them, holding what ours hold (a file of that name alone could be anyone's)."""
    record = json_object(directory / MLFLOW_RECORD)
    return (record is not None and {"run_id", "tracking_uri"} <= record.keys()
            and holds_only(directory, set(KEPT_FILES).__contains__))


# What `unmask eval` writes (RUN/report, --out): a directory that appears whole.
REPORT_KIND = OutputKind("report", "a report of `unmask eval`", whole=True, unmarked=_is_unmarked_report,
                         carried=frozenset(KEPT_FILES))


@dataclass(frozen=True)
class ReportFiles:
    """Where ``write_report`` put the report; ``plots`` lists only the plots it wrote."""

    markdown: Path
    html: Path
    json: Path | None   # None: a report of downstream tasks alone
    plots: list[Path]


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


def _is_autoregressive(results: EvalResults) -> bool:
    return results.model.objective == AUTOREGRESSIVE


# ------------------------------------------------------------------------- sections
def _title(results: EvalResults | DownstreamResults) -> str:
    return f"Evaluation report: {results.model.path} at step {_count(results.model.step)}"


def _header_blocks(results: EvalResults | DownstreamResults) -> list[Block]:
    model = results.model
    blocks: list[Block] = [
        Heading(1, _title(results)),
        paragraph(f"Objective: {model.objective}; weights: {model.weights}; "
                  f"tokens seen in training: {_count(model.tokens_seen)}."),
        paragraph("Created ", Code(results.created), " by unmask ", Code(results.unmask_version),
                  " at git commit ", Code(results.git_commit), "."),
    ]
    if results.mlflow:
        blocks.append(paragraph("MLflow run ", Code(results.mlflow.run_id), " at ",
                                Code(results.mlflow.tracking_uri), "."))
    return blocks


def _protocol_name(record: DatasetResult) -> str:
    """The protocol a number used: its dataset record names it, but for the training shards' val
    split, which only ours reads."""
    return record.dataset.get("protocol", UNMASK.name)


def _protocol_of(record: DatasetResult) -> str:
    """The protocol a number used and the split it scored, e.g. "mdlm, valid split"."""
    return f"{_protocol_name(record)}, {record.dataset.get('split', '?')} split"


def _results_row(name: str, protocol: str, record: DatasetResult, exact: bool) -> tuple[Inline, ...]:
    nelbo = _number(record.nelbo_per_token, 4)
    perplexity = _number(record.perplexity_bound, 2)
    if not exact:
        nelbo += f" ± {_number(record.standard_error, 4)}"
        low, high = record.perplexity_interval
        perplexity += f" ({_number(low, 2)} – {_number(high, 2)})"
    return (name, protocol, _count(record.num_tokens), nelbo, perplexity, _number(record.bits_per_byte, 4))


def _results_blocks(results: EvalResults) -> list[Block]:
    exact = _is_autoregressive(results)
    header = (("dataset", "protocol", "tokens", "NLL/token (nats)", "perplexity (exact)", "bits/byte") if exact else
              ("dataset", "protocol", "tokens", "NELBO/token (nats ± SE)", "perplexity bound (95% interval)",
               "bits/byte"))
    rows = tuple(_results_row(name, _protocol_of(record), record, exact)
                 for name, record in results.datasets.items())
    explanation = (
        "Exact negative log-likelihood per token of the causal model; perplexity = "
        "exp(NLL/token)." if exact else
        "NELBO/token: the negative evidence lower bound per token, ± its Monte Carlo standard "
        "error. The perplexity bound exp(NELBO/token) is an upper bound on the model's "
        "perplexity; its interval is the 95% Monte Carlo interval of that bound (more samples "
        "shrink the interval, not the bound).")
    return [Heading(2, "Results"), Table(header, rows),
            paragraph(explanation, " Tokens are counted with the model's tokenizer (EOS "
                      "included, and under the mdlm, bd3lm and duo protocols the scored BOS and EOS "
                      "around every block); "
                      "bits per byte divide the total by the UTF-8 bytes of the detokenized text "
                      "and do not depend on the tokenizer. The protocol column names how the set "
                      "was read and wrapped (evaluation.bounds.protocols) and the split it scored.")]


def _training_blocks(results: EvalResults) -> list[Block]:
    """The training's own validation bound before and after training (when known)."""
    training = results.training
    if not training:
        return []
    return [Heading(2, "Training"),
            paragraph(f"Validation bound during training (EMA weights, {training.val_split!r} split of the "
                      f"training data): {_number(training.untrained_val_nelbo_per_token, 4)} nats/token "
                      f"at step 0 (untrained), {_number(training.final_val_nelbo_per_token, 4)} nats/token "
                      f"at step {_count(training.final_step)}.")]


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _key_value_table(mapping: Mapping[str, Any]) -> Table:
    return Table(("field", "value"),
                 tuple((Code(key), Code(_raw(value))) for key, value in _flatten(mapping)))


def _by_dataset_table(records: dict[str, dict[str, Any]]) -> Table:
    """One row per field, one column per dataset: every field of every record, verbatim."""
    fields = list(dict.fromkeys(key for record in records.values() for key, _ in _flatten(record)))
    flat = {name: dict(_flatten(record)) for name, record in records.items()}
    rows = tuple((Code(field), *(Code(_raw(flat[name][field])) if field in flat[name] else MISSING
                                 for name in records))
                 for field in fields)
    return Table(("field", *records), rows)


def _protocol_blocks(results: EvalResults) -> list[Block]:
    datasets = results.datasets
    return [
        Heading(2, "Protocol"),
        paragraph("Every field needed to reproduce the numbers above, verbatim."),
        Heading(3, "Evaluation"), _key_value_table(results.protocol.to_json()),
        Heading(3, "Model"), _key_value_table(results.model.to_json()),
        Heading(3, "Dataset files"),
        _by_dataset_table({name: record.dataset for name, record in datasets.items()}),
        Heading(3, "Estimates"),
        _by_dataset_table({name: record.estimate for name, record in datasets.items()}),
    ]


def _schedule_token_table(tokens: tuple[ScheduleToken, ...]) -> Table:
    return Table(("token id", "text", "w"),
                 tuple((str(t.token), Code(repr(t.text)), _number(t.exponent, 3)) for t in tokens))


def _schedule_blocks(results: EvalResults) -> list[Block]:
    """A learned schedule's exponents: their spread, and the tokens that unmask first and last."""
    schedule = results.schedule
    if not schedule:
        return []
    return [Heading(2, "Learned schedule"),
            paragraph(f"Each token value v has its own schedule alpha_t = 1 - t^w_v (GenMD4). The exponents "
                      f"w_v range from {_number(schedule.exponent_min, 3)} (median "
                      f"{_number(schedule.exponent_median, 3)}) to {_number(schedule.exponent_max, 3)}. When "
                      f"sampling, a masked position of value v stays masked from t to s < t with probability "
                      f"about (s/t)^w_v: values of large w unmask first, values of small w last. Below w = 1/2 "
                      f"the training estimator's variance is infinite."),
            Heading(3, "Unmask first (largest w)"), _schedule_token_table(schedule.unmask_first),
            Heading(3, "Unmask last (smallest w)"), _schedule_token_table(schedule.unmask_last)]


def _sampling_blocks(sampling: SamplingRecord) -> list[Block]:
    """How the samples were drawn and their quality: unigram entropy, generative perplexity."""
    blocks: list[Block] = [
        paragraph(f"{sampling.num_samples} samples of {_count(sampling.seq_len)} tokens: "
                  f"{sampling.plan.describe()}. They needed {_number(sampling.mean_network_calls, 1)} network "
                  f"calls each on average. Mean unigram entropy: {_number(sampling.mean_unigram_entropy, 3)} nats "
                  f"(of each sample's own tokens; low values expose repetitive samples, which flatter the "
                  f"generative perplexity).")]
    perplexity = sampling.generative_perplexity
    if perplexity:
        tokens = ("the decoded text re-encoded with the reference's tokenizer (the tokenizers differ)"
                  if perplexity.retokenized else "the sampled tokens (the reference shares the tokenizer)")
        blocks.append(paragraph(f"Generative perplexity: {_number(perplexity.perplexity, 2)} under the "
                                f"{perplexity.reference_kind} model ", Code(perplexity.reference),
                                f", over {_count(perplexity.tokens)} tokens: {tokens}."))
    else:
        blocks.append(paragraph("No generative perplexity: no reference model was given (--reference)."))
    return blocks + _sweep_blocks(sampling)


def _sweep_blocks(sampling: SamplingRecord) -> list[Block]:
    """Every sampler at every budget of network calls (``--sample-sweep``)."""
    if not sampling.sweep:
        return []
    rows = tuple((row.sampler, _count(row.budget), _number(row.network_calls, 1),
                  _number(row.generative_perplexity, 2) if row.generative_perplexity is not None else "-",
                  _number(row.mean_unigram_entropy, 3)) for row in sampling.sweep)
    return [Heading(3, "Quality per network call"),
            Table(("sampler", "budget (steps)", "network calls per sample", "generative perplexity",
                   "mean unigram entropy (nats)"), rows),
            paragraph(f"{sampling.num_samples} samples per row, each sampler with its default options and the "
                      f"temperature, nucleus, grid and seed above. Lower perplexity is better only at a similar "
                      f"entropy.")]


def _sample_line(number: int, sample: SampleRecord) -> str:
    line = f"Sample {number}: {_count(sample.network_calls)} network calls"
    if sample.unigram_entropy is not ABSENT:
        line += f", unigram entropy {_number(sample.unigram_entropy, 3)} nats"
    if sample.reference_tokens:
        line += (f", {_number(sample.reference_nll / sample.reference_tokens, 3)} nats/token under the "
                 f"reference ({_count(sample.reference_tokens)} tokens)")
    return line + "."


def _sample_blocks(results: EvalResults) -> list[Block]:
    if not results.samples:
        return []
    blocks: list[Block] = [Heading(2, "Samples"), *(_sampling_blocks(results.sampling) if results.sampling else [])]
    for number, sample in enumerate(results.samples, start=1):
        blocks.append(paragraph(_sample_line(number, sample)))
        blocks.append(Quote(sample.text))
    return blocks


def _gap_row(name: str, ours: DatasetResult, theirs: DatasetResult) -> tuple[Inline, ...]:
    return (name, _number(ours.perplexity_bound, 2), _number(theirs.perplexity_bound, 2),
            _number(ours.nelbo_per_token - theirs.nelbo_per_token, 4),
            _number(ours.bits_per_byte - theirs.bits_per_byte, 4))


def _comparison_blocks(results: EvalResults) -> list[Block]:
    """This model next to another evaluation of the same data (``unmask eval --compare``):
    the diffusion-vs-AR gap on the same tokens when both share the tokenizer."""
    other = results.comparison
    if not other:
        return []
    ours, theirs = results.model, other.model
    header = ("dataset", f"this model ({ours.objective})", f"{theirs.objective}: {theirs.path}",
              "gap (nats/token)", "gap (bits/byte)")
    rows = tuple(_gap_row(name, record, other.datasets[name])
                 for name, record in results.datasets.items() if name in other.datasets)
    note = ("Both models share the tokenizer, so the per-token gap compares the same tokens."
            if _same_tokenizer(ours, theirs) else "The tokenizers differ: only the bits-per-byte gap is comparable.")
    differing = [name for name, record in results.datasets.items() if name in other.datasets
                 and _protocol_of(record) != _protocol_of(other.datasets[name])]
    if differing:
        note += (f" The two evaluations read {', '.join(differing)} with different protocols or splits: "
                 f"those gaps compare different tokens.")
    return [Heading(2, "Comparison"), Table(header, rows),
            paragraph("Perplexities (a bound for a diffusion model, exact for an autoregressive one); "
                      "a positive gap means this model's number is higher. ", note)]


def _same_tokenizer(ours: ModelRecord, theirs: ModelRecord) -> bool:
    return ours.tokenizer.sha256 == theirs.tokenizer.sha256


def _plot_blocks(plots: list[Plot]) -> list[Block]:
    return [Heading(2, "Plots"), *plots] if plots else []


def _metric(value: float | None) -> str:
    """A metric as lm-eval reports it: 4 decimals, or 4 significant digits when large."""
    if value is None or not math.isfinite(value) or abs(value) < 1e4:
        return _number(value, 4)
    return f"{value:.4g}"


def _downstream_documents(record: TaskResult) -> str:
    documents = _count(record.documents)
    if record.documents_total == record.documents:
        return documents
    return f"{documents} of {_count(record.documents_total)}"


def _downstream_likelihood_row(task: str, record: TaskResult, exact: bool) -> tuple[Inline, ...]:
    error = "0 (exact)" if exact else _number(record.monte_carlo_error, 4)
    median = "0 (exact)" if exact else _number(record.median_request_error, 4)
    return (task, _count(record.requests), _number(record.mean_log_likelihood, 4), error, median,
            _count(record.truncated_contexts))


def _downstream_blocks(downstream: DownstreamResults | None, step: int | None) -> list[Block]:
    """The lm-eval tasks: every metric as lm-eval names it with its standard error over
    documents, then each task's mean log-likelihood per request with its Monte Carlo error."""
    if downstream is None:
        return []
    settings = downstream.settings
    exact = downstream.model.objective == AUTOREGRESSIVE
    metrics = tuple((task, Code(key), _metric(value), _metric(error), _downstream_documents(record))
                    for task, record in downstream.tasks.items() for key, (value, error) in record.values().items())
    likelihoods = tuple(_downstream_likelihood_row(task, record, exact) for task, record in downstream.tasks.items()
                        if record.requests)
    fewshot, guidance = settings.get("num_fewshot"), settings.get("guidance")
    if exact:
        meaning = ("The model's log-likelihoods are exact (autoregressive): these are the numbers lm-eval gives "
                   "any causal model.")
    elif guidance is not None:  # a different distribution (docs/fast-generation.md): never read as a bound
        meaning = (f"Each score is guided (unsupervised classifier-free guidance, weight {guidance:g}): the "
                   f"continuation's Monte Carlo ELBO under the guided logits, the unconditional pass with the "
                   f"context masked, from {settings.get('samples')} time samples per request (seed "
                   f"{settings.get('seed')}), at two forward passes a call. It ranks the choices, and accuracies "
                   f"compare these scores; it is not a likelihood bound of the model, nor are the perplexities. "
                   f"The ± of a metric is lm-eval's, over documents; the Monte Carlo error of the scores is in "
                   f"the second table.")
    else:
        meaning = (
            f"Each log-likelihood is a Monte Carlo lower bound: the conditional ELBO of the continuation with the "
            f"context kept visible, from {settings.get('samples')} time samples per request (seed "
            f"{settings.get('seed')}). Accuracies compare these bounds and perplexities are upper bounds; the acc of "
            f"LAMBADA-style tasks uses is_greedy, approximated by the argmax of one prediction at the all-masked "
            f"continuation (evaluation.downstream.likelihoods). The ± of a metric is lm-eval's, over documents; "
            f"the Monte Carlo error of the bounds is in the second table (of the task's mean, and the median "
            f"request's own).")
    blocks: list[Block] = [
        Heading(2, "Downstream tasks"),
        paragraph(f"lm-evaluation-harness {downstream.lm_eval_version} on the export at step "
                  f"{_count(downstream.model.step)} ({downstream.created}); lm-eval's own results are in ",
                  Code(downstream.lm_eval_results), f". Documents per task: "
                  f"{'all' if settings.get('limit') is None else 'at most ' + _raw(settings.get('limit'))}; "
                  f"few-shot examples: {'each task' + chr(39) + 's own' if fewshot is None else fewshot}."),
        Table(("task", "metric", "value", "± (documents)", "documents"), metrics), paragraph(meaning)]
    if likelihoods:
        mean = ("mean log-likelihood per request (nats)" if guidance is None else
                "mean guided score per request (nats; not a bound)")
        blocks.append(Table(("task", "requests", mean, "± Monte Carlo",
                             "median request's ±", "contexts cut to fit"), likelihoods))
    if step != downstream.model.step:
        blocks.append(paragraph(f"These tasks scored the export at step {_count(downstream.model.step)}; the "
                                f"bounds above, step {_count(step)}."))
    return blocks


def _document(results: EvalResults, plots: list[Plot], downstream: DownstreamResults | None) -> list[Block]:
    return [*_header_blocks(results), *_results_blocks(results), *_downstream_blocks(downstream, results.model.step),
            *_training_blocks(results), *_schedule_blocks(results), *_comparison_blocks(results),
            *zero_shot_blocks(results), *_sample_blocks(results), *_plot_blocks(plots), *_protocol_blocks(results)]


# ------------------------------------------------------------------------- reading and writing
def read_record(path: Path, read: Callable[[Path], Record]) -> Record | None:
    """A record a report is built from (``results.json``, ``downstream.json``) read with
    ``read``, or None when there is none: one that cannot be read costs a warning, not the report."""
    if not Path(path).is_file():
        return None
    try:
        return read(Path(path))
    except (OSError, ValueError) as err:
        log.warning("%s: left out of the report (%s)", path, err)
        return None


# ------------------------------------------------------------------------- writing
def write_report(results: EvalResults | Mapping[str, Any] | None, out_dir: Path, *,
                 curves: Curves | None = None, downstream: DownstreamResults | None = None,
                 lm_eval_results: bytes | None = None) -> ReportFiles:
    """Write the report into the new directory ``out_dir`` (module docstring).

    ``results``: typed, or the JSON object of a results.json (read with
    ``EvalResults.from_json``); ``curves`` maps a metric name to its (step, value) points;
    ``downstream``: the lm-eval tasks' section, written as downstream.json beside lm-eval's
    own ``lm_eval_results`` (with ``results=None``, the report is that section alone and no
    results.json is written). The ``KEPT_FILES`` of the directory replaced are carried over
    unless given anew. Everything is rendered before the first file is written, and the
    directory appears whole: malformed ``results`` (ValueError naming what they lack) or a
    failed write leave ``out_dir`` as it was.
    """
    out_dir = Path(out_dir)
    if results is None and downstream is None:
        raise ValueError("write_report needs results, downstream results, or both")
    if results is not None and not isinstance(results, EvalResults):
        results = EvalResults.from_json(dict(results))
    plots = [] if results is None else report_plots(results, curves)
    if results is None:
        document = [*_header_blocks(downstream), *_downstream_blocks(downstream, downstream.model.step)]
    else:
        document = _document(results, plots, downstream)
    contents = {plot.relative_path: plot.png for plot in plots}
    if results is not None:
        contents[Path(JSON_NAME)] = results.dumps().encode("utf-8")
    if downstream is not None:
        contents[Path(DOWNSTREAM_JSON)] = downstream.dumps().encode("utf-8")
    if lm_eval_results is not None:
        contents[Path(LM_EVAL_JSON)] = lm_eval_results
    contents[Path(MARKDOWN_NAME)] = render_markdown(document).encode("utf-8")
    contents[Path(HTML_NAME)] = render_html(document, _title(results or downstream)).encode("utf-8")
    with new_output_dir(out_dir, REPORT_KIND, "--out") as staging:  # carries the KEPT_FILES not given
        for path, data in contents.items():
            (staging / path).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(staging / path, data)
    return ReportFiles(out_dir / MARKDOWN_NAME, out_dir / HTML_NAME, None if results is None else out_dir / JSON_NAME,
                       [out_dir / plot.relative_path for plot in plots])
