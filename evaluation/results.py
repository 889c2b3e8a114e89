"""The results files, typed: ``results.json`` (``unmask eval``, ``EvalResults``) and
``downstream.json`` (``unmask lm-eval``, ``DownstreamResults``), record by record.

    results = EvalResults.read(Path("runs/tiny/report/results.json"))
    results.model.step, results.datasets["ptb"].perplexity_bound, results.protocol.samples_per_block
    text = results.dumps()  # the bytes of results.json, as unmask writes them

Every record is written and read from its fields (``evaluation.records``): a field that may
hold ``ABSENT`` is a key the file may lack, None is written as null, and a file is read only
whole (one ValueError names every key it lacks and says how to write it anew). ``training`` is
the one key whose three states all occur: absent for an export of no training run, null for a
run whose metrics hold no validation at step 0. ``dataset``, ``estimate``, ``network``,
``metrics`` and ``settings`` stay JSON objects, kept verbatim. The schema, as JSON:
docs/evaluation.md#the-results-files and docs/downstream.md#downstreamjson.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from evaluation.records import ABSENT, Absent, JsonObject, Record, RecordFile
from model.sampling import SamplingPlan

__all__ = ["ABSENT", "DOWNSTREAM_JSON", "LM_EVAL_JSON", "Absent", "Comparison", "DatasetResult", "DownstreamResults",
           "EvalResults", "GenerativePerplexity", "MissingDataset", "MlflowRecord", "ModelRecord",
           "PerTimeContributions", "ProtocolRecord", "SampleRecord", "SamplingRecord", "ScheduleRecord",
           "ScheduleToken", "SuiteRecord", "SweepRow", "TaskResult", "TokenizerRecord", "TrainingRecord"]

DOWNSTREAM_JSON = "downstream.json"
LM_EVAL_JSON = "lm_eval_results.json"   # lm-eval's own results, beside downstream.json


@dataclass(frozen=True, kw_only=True)
class TokenizerRecord(Record):
    """The model's tokenizer, by content."""

    kind: str
    sha256: str
    vocab_size: int


@dataclass(frozen=True, kw_only=True)
class ModelRecord(Record):
    """The export that was evaluated: where, what, which weights. In this order: the report's
    "Model" table lists the fields as they come."""

    path: str
    objective: str                        # "diffusion" | "autoregressive"
    step: int | None                      # the checkpoint's step
    tokens_seen: int | None
    weights: str | None                   # "ema" | "model", or an imported export's own word
    weights_note: str | Absent = ABSENT   # the weights, in words
    init_from: JsonObject | Absent = ABSENT  # where training started (--init-from): source, kind, family,
                                          # sha256 of its weights, an adapted model's adaptation
    network: JsonObject                   # the export's network config, verbatim
    tokenizer: TokenizerRecord


@dataclass(frozen=True, kw_only=True)
class MissingDataset(Record):
    """A set of a suite that was not scored: its files were not under --data-dir."""

    name: str
    split: str
    expected: str   # the files it is read from, and where to get them


@dataclass(frozen=True, kw_only=True)
class SuiteRecord(Record):
    """The suite an evaluation scored (``--suite``), and its sets that were missing."""

    name: str
    missing: tuple[MissingDataset, ...]


@dataclass(frozen=True, kw_only=True)
class ProtocolRecord(Record):
    """How the numbers were made: every setting needed to reproduce them. In this order: the
    report's "Evaluation" table lists the fields as they come."""

    name: str                             # the protocol (evaluation.bounds.protocols): unmask, mdlm, bd3lm, duo
    seq_len: int
    samples_per_block: int
    seed: int
    estimator: str                        # "continuous" | "discrete" | "autoregressive"
    discrete_steps: int | None
    target_rel_error: float | None
    add_eos: bool
    split: str                            # the protocol's, or --split
    max_documents: int | None             # only the first documents of each set (quick looks)
    blocks_per_replicate: int | None | Absent = ABSENT   # a random subset of blocks per replicate
    wrapping: str                         # how documents became blocks, in words
    bound: str                            # which bound, in words
    block_size: int | Absent = ABSENT     # block diffusion's L' (absent: one block, MDLM)
    precision: str
    world_size: int
    suite: SuiteRecord | Absent = ABSENT  # the suite the datasets came from (evaluation.bounds.suites)


@dataclass(frozen=True, kw_only=True)
class PerTimeContributions(Record):
    """Blocks' contributions to the bound against their time t (the report's per-t plot)."""

    t: list[float]
    contribution: list[float]   # nats per token, one per entry of t


@dataclass(frozen=True, kw_only=True)
class DatasetResult(Record):
    """The bound on one dataset, with the file it read and the estimate it came from."""

    dataset: JsonObject            # what was read and how (EvalDataset.protocol() or the val split's)
    estimate: JsonObject           # BoundEstimate.to_dict()
    perplexity_bound: float
    perplexity_interval: tuple[float, float]   # 95% Monte Carlo interval of the bound
    nelbo_per_token: float         # nats; exact NLL for an autoregressive model
    standard_error: float
    bits_per_byte: float
    num_tokens: int
    per_t: PerTimeContributions | Absent = ABSENT   # diffusion models only


@dataclass(frozen=True, kw_only=True)
class SampleRecord(Record):
    """One generated sample, as the report shows it, with its quality (evaluation.generation.sample_quality)."""

    text: str
    network_calls: int                          # the network evaluations it needed
    unigram_entropy: float | Absent = ABSENT    # nats, of the sample's own tokens
    reference_nll: float | Absent = ABSENT      # nats, -log p of its text under the reference model
    reference_tokens: int | Absent = ABSENT     # the reference's tokens of its text


@dataclass(frozen=True, kw_only=True)
class GenerativePerplexity(Record):
    """The samples' perplexity under a reference autoregressive model."""

    reference: str        # the reference model's path
    reference_kind: str   # "unmask-export" | "huggingface"
    retokenized: bool     # the decoded text re-encoded with the reference's tokenizer (else the sampled ids)
    perplexity: float     # exp(total NLL / total tokens) over all samples
    tokens: int           # the reference's tokens, over all samples


@dataclass(frozen=True, kw_only=True)
class SweepRow(Record):
    """The samples of one sampler at one budget of network calls (``evaluation.generation.sampler_sweep``)."""

    sampler: str
    budget: int                          # the plan's steps: the most network calls per sample
    network_calls: float                 # the mean calls a sample needed
    mean_unigram_entropy: float          # nats
    generative_perplexity: float | None  # None without a reference model


@dataclass(frozen=True, kw_only=True)
class SamplingRecord(Record):
    """How the report's samples were drawn (one plan), and their quality."""

    num_samples: int
    plan: SamplingPlan             # written as SamplingPlan.to_dict()
    seq_len: int
    mean_unigram_entropy: float    # nats, the mean over samples of each one's unigram entropy
    mean_network_calls: float      # the network evaluations a sample needed, on average
    generative_perplexity: GenerativePerplexity | Absent = ABSENT   # with a reference model only
    sweep: tuple[SweepRow, ...] | Absent = ABSENT                   # quality per sampler and budget


@dataclass(frozen=True, kw_only=True)
class ScheduleToken(Record):
    """A token value of a learned schedule: its id, its decoded text and its exponent w_v."""

    token: int
    text: str
    exponent: float


@dataclass(frozen=True, kw_only=True)
class ScheduleRecord(Record):
    """A learned schedule (GenMD4, alpha_{t,v} = 1 - t^{w_v}): the spread of its exponents and
    the token values that unmask first (largest w, largest first) and last (smallest first)."""

    exponent_min: float
    exponent_median: float
    exponent_max: float
    unmask_first: tuple[ScheduleToken, ...]
    unmask_last: tuple[ScheduleToken, ...]


@dataclass(frozen=True, kw_only=True)
class MlflowRecord(Record):
    """The MLflow run that holds the metrics and the report."""

    tracking_uri: str
    run_id: str


@dataclass(frozen=True, kw_only=True)
class TrainingRecord(Record):
    """The training's own validation bound, before training (step 0) and at its last validation."""

    untrained_val_nelbo_per_token: float
    final_step: int
    final_val_nelbo_per_token: float
    val_split: str


@dataclass(frozen=True, kw_only=True)
class Comparison(Record):
    """Another evaluation (``unmask eval --compare``) on the datasets both scored."""

    model: ModelRecord
    datasets: dict[str, DatasetResult]
    path: str   # its results.json


@dataclass(frozen=True, kw_only=True)
class EvalResults(RecordFile):
    """Everything ``unmask eval`` found out and how; written as ``results.json``."""

    model: ModelRecord
    protocol: ProtocolRecord
    datasets: dict[str, DatasetResult]
    samples: tuple[SampleRecord, ...]
    mlflow: MlflowRecord | None           # None: not logged (the tracking server was down)
    created: str                          # ISO 8601, UTC
    unmask_version: str
    git_commit: str
    training: TrainingRecord | None | Absent = ABSENT
    comparison: Comparison | Absent = ABSENT
    schedule: ScheduleRecord | Absent = ABSENT   # learned-schedule exports only
    sampling: SamplingRecord | Absent = ABSENT   # with samples only

    WHAT = "results"
    REDO = "rerun `unmask eval` to write them anew"


# ------------------------------------------------------------------ downstream.json
@dataclass(frozen=True, kw_only=True)
class TaskResult(Record):
    """One lm-eval task: its metrics as lm-eval reports them, and our Monte Carlo record."""

    metrics: dict[str, Any]              # lm-eval's keys ("acc,none", "acc_stderr,none", ...), verbatim
    higher_is_better: dict[str, bool]
    documents: int                       # scored (after --limit)
    documents_total: int                 # in the task
    requests: int = 0                    # loglikelihood requests scored
    mean_log_likelihood: float | None = None    # per request, nats (None: no such requests)
    monte_carlo_error: float | None = None      # of mean_log_likelihood (0: exact)
    median_request_error: float | None = None   # the median request's own error
    truncated_contexts: int = 0          # requests whose context was cut on the left

    def values(self) -> dict[str, tuple[float, float | None]]:
        """metric[,filter] -> (value, lm-eval's standard error over documents or None): the
        numeric metrics only, without their ``_stderr`` companions."""
        out = {}
        for key, value in self.metrics.items():
            name, _, where = key.partition(",")
            if name.endswith("_stderr") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            error = self.metrics.get(f"{name}_stderr,{where}" if where else f"{name}_stderr")
            out[key] = (float(value), float(error) if isinstance(error, (int, float)) else None)
        return out


@dataclass(frozen=True, kw_only=True)
class DownstreamResults(RecordFile):
    """Everything ``unmask lm-eval`` found out and how; written as ``downstream.json`` beside
    lm-eval's own results file."""

    model: ModelRecord
    tasks: dict[str, TaskResult]
    settings: dict[str, Any] = field(default_factory=dict)   # tasks, limit, samples K, seed, batch size, ...
    lm_eval_version: str
    lm_eval_results: str                  # the name of lm-eval's results file beside it
    mlflow: MlflowRecord | None = None
    created: str                          # ISO 8601, UTC
    unmask_version: str
    git_commit: str

    WHAT = "downstream results"
    REDO = "rerun `unmask lm-eval` to write them anew"

    def with_mlflow(self, record: MlflowRecord | None) -> DownstreamResults:
        return replace(self, mlflow=record)
