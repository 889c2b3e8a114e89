"""The results of ``unmask eval``, typed: what ``results.json`` holds, record by record.

    results = EvalResults.read(Path("runs/tiny/report/results.json"))
    results.model.step, results.datasets["ptb"].perplexity_bound, results.protocol.samples_per_block
    text = results.dumps()  # the bytes of results.json, as unmask writes them

Every record has ``to_json()``, the JSON object it is written as, and ``from_json()``, which
reads one back: ``from_json(r.to_json()) == r``, and ``from_json(d).to_json() == d`` for every
``d`` that unmask writes (keys the records do not know are ignored). A key that a results.json
may lack is a field that may hold ``ABSENT``: it is left out of the JSON, whereas None is written
as null. ``training`` is the one such key whose three states all occur: absent for an export
that belongs to no training run, null for a run whose metrics hold no validation at step 0.

The records, as JSON (``?`` marks a key that may be absent)::

    {"model": ModelRecord {"path": str, "objective": "diffusion" | "autoregressive",
               "step": int | None, "tokens_seen": int | None, "weights": "ema" | "model" | None,
               "weights_note"?: str, "network": {"n_layers", "d_model", ...: the export's verbatim},
               "tokenizer": {"kind": str, "sha256": str, "vocab_size": int}},
     "protocol": Protocol {"name"?: "unmask" | "mdlm" (absent: unmask), "seq_len": int,
                  "samples_per_block": int, "seed": int,
                  "estimator": "continuous" | "discrete" | "autoregressive",
                  "discrete_steps": int | None, "target_rel_error": float | None, "add_eos": bool,
                  "split"?: str, "max_documents"?: int | None, "wrapping": str, "bound"?: str,
                  "block_size"?: int (block diffusion's L'),
                  "precision": str, "world_size": int},
     "datasets": {NAME: DatasetResult {"dataset": {...},   # the file read and how (EvalDataset.protocol(),
                                                           # "protocol", "dropped_tokens" under mdlm)
                                       "estimate": {...},  # BoundEstimate.to_dict()
                                       "nelbo_per_token": float, "standard_error": float,
                                       "perplexity_bound": float, "perplexity_interval": [low, high],
                                       "bits_per_byte": float, "num_tokens": int,
                                       "per_t"?: {"t": [float], "contribution": [float]}}},
     "samples": [{"text": str, "network_calls": int,                   # may be empty
                  "unigram_entropy"?: float, "reference_nll"?: float, "reference_tokens"?: int}],
     "sampling"?: {"num_samples": int, "plan": {...},   # model.sampling.SamplingPlan.to_dict()
                   "seq_len": int, "mean_unigram_entropy": float, "mean_network_calls": float,
                   "generative_perplexity"?: {"reference": str, "reference_kind": str,
                                              "retokenized": bool, "perplexity": float, "tokens": int},
                   "sweep"?: [{"sampler": str, "budget": int, "network_calls": float,
                               "mean_unigram_entropy": float, "generative_perplexity": float | None}]},
     "mlflow": {"tracking_uri": str, "run_id": str} | None,           # None: MLflow was down
     "created": ISO 8601 str, "unmask_version": str, "git_commit": str,
     "training"?: {"untrained_val_nelbo_per_token": float, "final_step": int,
                   "final_val_nelbo_per_token": float, "val_split": str} | None,
     "comparison"?: {"model": ModelRecord, "datasets": {NAME: DatasetResult}, "path": str},
     "schedule"?: {"exponent_min": float, "exponent_median": float, "exponent_max": float,  # learned
                   "unmask_first": [{"token": int, "text": str, "exponent": float}],        # schedules
                   "unmask_last": [...]}}

``EvalResults.from_json`` checks the whole object before it reads it: a ValueError names every
key it lacks. A record's own ``from_json`` expects what its part of that check accepts.

``dataset``, ``estimate`` and ``network`` stay JSON objects: they are other modules' records,
kept and shown verbatim (their keys differ between a text file and the training shards).
"""

from __future__ import annotations

import copy
import enum
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from model.sampling import SamplingPlan

__all__ = ["ABSENT", "Absent", "Comparison", "DatasetResult", "EvalResults", "EvalScores", "GenerativePerplexity",
           "MlflowRecord", "ModelRecord", "PerTimeContributions", "Protocol", "SampleRecord", "SamplingRecord",
           "ScheduleRecord", "ScheduleToken", "SweepRow", "TokenizerRecord", "TrainingRecord"]

JsonObject = dict[str, Any]
Keys = tuple[str, ...]


class Absent(enum.Enum):
    """The type of ``ABSENT``: a key that the JSON leaves out (None is written as null)."""

    ABSENT = "absent"

    def __bool__(self) -> bool:
        return False  # "if results.training:" reads as "when there is one"

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = Absent.ABSENT


# ----------------------------------------------------------------------- JSON helpers
def _present(pairs: JsonObject) -> JsonObject:
    """The JSON object of ``pairs`` without the ABSENT ones."""
    return {key: value for key, value in pairs.items() if value is not ABSENT}


def _lacking(data: Any, where: str, keys: Iterable[str]) -> list[str]:
    """The dotted names of the ``keys`` that the JSON object at ``where`` lacks (all of it
    when it is not an object)."""
    if not isinstance(data, dict):
        return [where.rstrip(".") or "results"]
    return [f"{where}{key}" for key in keys if key not in data]


def _check(missing: list[str]) -> None:
    if missing:
        raise ValueError(f"results lack {', '.join(missing)} (see evaluation.results for the schema)")


# ----------------------------------------------------------------------- the records
@dataclass(frozen=True, kw_only=True)
class TokenizerRecord:
    """The model's tokenizer, by content."""

    kind: str
    sha256: str
    vocab_size: int

    KEYS: ClassVar[Keys] = ("kind", "sha256", "vocab_size")

    def to_json(self) -> JsonObject:
        return {"kind": self.kind, "sha256": self.sha256, "vocab_size": self.vocab_size}

    @classmethod
    def from_json(cls, data: JsonObject) -> TokenizerRecord:
        return cls(**{key: data[key] for key in cls.KEYS})


@dataclass(frozen=True, kw_only=True)
class ModelRecord:
    """The export that was evaluated: where, what, which weights."""

    path: str
    objective: str                        # "diffusion" | "autoregressive"
    step: int | None                      # the checkpoint's step
    tokens_seen: int | None
    weights: str | None                   # "ema" | "model"
    weights_note: str | Absent = ABSENT   # the weights, in words
    network: JsonObject                   # the export's network config, verbatim
    tokenizer: TokenizerRecord

    REQUIRED: ClassVar[Keys] = ("path", "objective", "step", "tokens_seen", "weights", "network", "tokenizer")

    @classmethod
    def missing(cls, data: Any, where: str) -> list[str]:
        """What the JSON object at ``where`` lacks to be a model record."""
        missing = _lacking(data, where, cls.REQUIRED)
        if isinstance(data, dict) and "tokenizer" in data:
            missing += _lacking(data["tokenizer"], f"{where}tokenizer.", TokenizerRecord.KEYS)
        return missing

    def to_json(self) -> JsonObject:
        # In this order: the report's "Model" table lists the fields as they come.
        return _present({"path": self.path, "objective": self.objective, "step": self.step,
                         "tokens_seen": self.tokens_seen, "weights": self.weights,
                         "weights_note": self.weights_note, "network": copy.deepcopy(self.network),
                         "tokenizer": self.tokenizer.to_json()})

    @classmethod
    def from_json(cls, data: JsonObject) -> ModelRecord:
        return cls(path=data["path"], objective=data["objective"], step=data["step"],
                   tokens_seen=data["tokens_seen"], weights=data["weights"],
                   weights_note=data.get("weights_note", ABSENT), network=copy.deepcopy(data["network"]),
                   tokenizer=TokenizerRecord.from_json(data["tokenizer"]))


@dataclass(frozen=True, kw_only=True)
class Protocol:
    """How the numbers were made: every setting needed to reproduce them."""

    name: str | Absent = ABSENT           # the protocol (evaluation.bounds.protocols); absent in older results: unmask
    seq_len: int
    samples_per_block: int
    seed: int
    estimator: str                        # "continuous" | "discrete" | "autoregressive"
    discrete_steps: int | None
    target_rel_error: float | None
    add_eos: bool
    split: str | Absent = ABSENT
    max_documents: int | None | Absent = ABSENT
    blocks_per_replicate: int | None | Absent = ABSENT   # a random subset of blocks per replicate
    wrapping: str                         # how documents became blocks, in words
    bound: str | Absent = ABSENT          # which bound, in words
    block_size: int | Absent = ABSENT     # block diffusion's L' (absent: one block, MDLM)
    precision: str
    world_size: int

    REQUIRED: ClassVar[Keys] = ("seq_len", "samples_per_block", "seed", "estimator", "discrete_steps",
                                "target_rel_error", "add_eos", "wrapping", "precision", "world_size")
    OPTIONAL: ClassVar[Keys] = ("name", "split", "max_documents", "blocks_per_replicate", "bound", "block_size")

    def to_json(self) -> JsonObject:
        # In this order: the report's "Evaluation" table lists the fields as they come.
        return _present({"name": self.name, "seq_len": self.seq_len, "samples_per_block": self.samples_per_block,
                         "seed": self.seed, "estimator": self.estimator, "discrete_steps": self.discrete_steps,
                         "target_rel_error": self.target_rel_error, "add_eos": self.add_eos,
                         "split": self.split, "max_documents": self.max_documents,
                         "blocks_per_replicate": self.blocks_per_replicate, "wrapping": self.wrapping,
                         "bound": self.bound, "block_size": self.block_size, "precision": self.precision,
                         "world_size": self.world_size})

    @classmethod
    def from_json(cls, data: JsonObject) -> Protocol:
        return cls(**{key: data[key] for key in cls.REQUIRED},
                   **{key: data.get(key, ABSENT) for key in cls.OPTIONAL})


@dataclass(frozen=True, kw_only=True)
class PerTimeContributions:
    """Blocks' contributions to the bound against their time t (the report's per-t plot)."""

    t: list[float]
    contribution: list[float]   # nats per token, one per entry of t

    def to_json(self) -> JsonObject:
        return {"t": list(self.t), "contribution": list(self.contribution)}

    @classmethod
    def from_json(cls, data: JsonObject) -> PerTimeContributions:
        return cls(t=list(data["t"]), contribution=list(data["contribution"]))


@dataclass(frozen=True, kw_only=True)
class DatasetResult:
    """The bound on one dataset, with the file it read and the estimate it came from."""

    dataset: JsonObject            # what was read and how (EvalDataset.protocol() or the val split's)
    estimate: JsonObject           # BoundEstimate.to_dict()
    nelbo_per_token: float         # nats; exact NLL for an autoregressive model
    standard_error: float
    perplexity_bound: float
    perplexity_interval: tuple[float, float]   # 95% Monte Carlo interval of the bound
    bits_per_byte: float
    num_tokens: int
    per_t: PerTimeContributions | Absent = ABSENT   # diffusion models only

    REQUIRED: ClassVar[Keys] = ("dataset", "estimate", "perplexity_bound", "perplexity_interval",
                                "nelbo_per_token", "standard_error", "bits_per_byte", "num_tokens")

    @classmethod
    def missing(cls, data: Any, where: str) -> list[str]:
        """What the JSON object at ``where`` lacks to be a dataset result."""
        missing = _lacking(data, where, cls.REQUIRED)
        if isinstance(data, dict) and isinstance(data.get("per_t"), dict):
            missing += _lacking(data["per_t"], f"{where}per_t.", ("t", "contribution"))
        return missing

    def to_json(self) -> JsonObject:
        low, high = self.perplexity_interval
        return _present({"dataset": copy.deepcopy(self.dataset), "estimate": copy.deepcopy(self.estimate),
                         "nelbo_per_token": self.nelbo_per_token, "standard_error": self.standard_error,
                         "perplexity_bound": self.perplexity_bound, "perplexity_interval": [low, high],
                         "bits_per_byte": self.bits_per_byte, "num_tokens": self.num_tokens,
                         "per_t": self.per_t.to_json() if self.per_t else ABSENT})

    @classmethod
    def from_json(cls, data: JsonObject) -> DatasetResult:
        low, high = data["perplexity_interval"]
        return cls(dataset=copy.deepcopy(data["dataset"]), estimate=copy.deepcopy(data["estimate"]),
                   nelbo_per_token=data["nelbo_per_token"], standard_error=data["standard_error"],
                   perplexity_bound=data["perplexity_bound"], perplexity_interval=(low, high),
                   bits_per_byte=data["bits_per_byte"], num_tokens=data["num_tokens"],
                   per_t=PerTimeContributions.from_json(data["per_t"]) if "per_t" in data else ABSENT)


@dataclass(frozen=True, kw_only=True)
class SampleRecord:
    """One generated sample, as the report shows it, with its quality (evaluation.generation.sample_quality)."""

    text: str
    network_calls: int                          # the network evaluations it needed
    unigram_entropy: float | Absent = ABSENT    # nats, of the sample's own tokens
    reference_nll: float | Absent = ABSENT      # nats, -log p of its text under the reference model
    reference_tokens: int | Absent = ABSENT     # the reference's tokens of its text

    KEYS: ClassVar[Keys] = ("text", "network_calls")
    OPTIONAL: ClassVar[Keys] = ("unigram_entropy", "reference_nll", "reference_tokens")

    def to_json(self) -> JsonObject:
        return _present({key: getattr(self, key) for key in self.KEYS + self.OPTIONAL})

    @classmethod
    def from_json(cls, data: JsonObject) -> SampleRecord:
        return cls(**{key: data[key] for key in cls.KEYS}, **{key: data.get(key, ABSENT) for key in cls.OPTIONAL})


@dataclass(frozen=True, kw_only=True)
class GenerativePerplexity:
    """The samples' perplexity under a reference autoregressive model."""

    reference: str        # the reference model's path
    reference_kind: str   # "unmask-export" | "huggingface"
    retokenized: bool     # the decoded text re-encoded with the reference's tokenizer (else the sampled ids)
    perplexity: float     # exp(total NLL / total tokens) over all samples
    tokens: int           # the reference's tokens, over all samples

    KEYS: ClassVar[Keys] = ("reference", "reference_kind", "retokenized", "perplexity", "tokens")

    def to_json(self) -> JsonObject:
        return {key: getattr(self, key) for key in self.KEYS}

    @classmethod
    def from_json(cls, data: JsonObject) -> GenerativePerplexity:
        return cls(**{key: data[key] for key in cls.KEYS})


@dataclass(frozen=True, kw_only=True)
class SweepRow:
    """The samples of one sampler at one budget of network calls (``evaluation.generation.sampler_sweep``)."""

    sampler: str
    budget: int                          # the plan's steps: the most network calls per sample
    network_calls: float                 # the mean calls a sample needed
    mean_unigram_entropy: float          # nats
    generative_perplexity: float | None  # None without a reference model

    KEYS: ClassVar[Keys] = ("sampler", "budget", "network_calls", "mean_unigram_entropy", "generative_perplexity")

    def to_json(self) -> JsonObject:
        return {key: getattr(self, key) for key in self.KEYS}

    @classmethod
    def from_json(cls, data: JsonObject) -> SweepRow:
        return cls(**{key: data[key] for key in cls.KEYS})


@dataclass(frozen=True, kw_only=True)
class SamplingRecord:
    """How the report's samples were drawn (one plan), and their quality."""

    num_samples: int
    plan: SamplingPlan
    seq_len: int
    mean_unigram_entropy: float    # nats, the mean over samples of each one's unigram entropy
    mean_network_calls: float      # the network evaluations a sample needed, on average
    generative_perplexity: GenerativePerplexity | Absent = ABSENT   # with a reference model only
    sweep: tuple[SweepRow, ...] | Absent = ABSENT                   # quality per sampler and budget

    KEYS: ClassVar[Keys] = ("num_samples", "plan", "seq_len", "mean_unigram_entropy", "mean_network_calls")

    def to_json(self) -> JsonObject:
        return _present({"num_samples": self.num_samples, "plan": self.plan.to_dict(), "seq_len": self.seq_len,
                         "mean_unigram_entropy": self.mean_unigram_entropy,
                         "mean_network_calls": self.mean_network_calls,
                         "generative_perplexity": self.generative_perplexity.to_json()
                         if self.generative_perplexity else ABSENT,
                         "sweep": [row.to_json() for row in self.sweep] if self.sweep else ABSENT})

    @classmethod
    def from_json(cls, data: JsonObject) -> SamplingRecord:
        perplexity, sweep = data.get("generative_perplexity"), data.get("sweep")
        return cls(num_samples=data["num_samples"], plan=SamplingPlan.from_dict(data["plan"]), seq_len=data["seq_len"],
                   mean_unigram_entropy=data["mean_unigram_entropy"], mean_network_calls=data["mean_network_calls"],
                   generative_perplexity=ABSENT if perplexity is None else GenerativePerplexity.from_json(perplexity),
                   sweep=ABSENT if sweep is None else tuple(SweepRow.from_json(row) for row in sweep))


@dataclass(frozen=True, kw_only=True)
class ScheduleToken:
    """A token value of a learned schedule: its id, its decoded text and its exponent w_v."""

    token: int
    text: str
    exponent: float

    KEYS: ClassVar[Keys] = ("token", "text", "exponent")

    def to_json(self) -> JsonObject:
        return {key: getattr(self, key) for key in self.KEYS}

    @classmethod
    def from_json(cls, data: JsonObject) -> ScheduleToken:
        return cls(**{key: data[key] for key in cls.KEYS})


@dataclass(frozen=True, kw_only=True)
class ScheduleRecord:
    """A learned schedule (GenMD4, alpha_{t,v} = 1 - t^{w_v}): the spread of its exponents and
    the token values that unmask first (largest w, largest first) and last (smallest first)."""

    exponent_min: float
    exponent_median: float
    exponent_max: float
    unmask_first: tuple[ScheduleToken, ...]
    unmask_last: tuple[ScheduleToken, ...]

    KEYS: ClassVar[Keys] = ("exponent_min", "exponent_median", "exponent_max", "unmask_first", "unmask_last")

    def to_json(self) -> JsonObject:
        return {"exponent_min": self.exponent_min, "exponent_median": self.exponent_median,
                "exponent_max": self.exponent_max, "unmask_first": [t.to_json() for t in self.unmask_first],
                "unmask_last": [t.to_json() for t in self.unmask_last]}

    @classmethod
    def from_json(cls, data: JsonObject) -> ScheduleRecord:
        return cls(exponent_min=data["exponent_min"], exponent_median=data["exponent_median"],
                   exponent_max=data["exponent_max"],
                   unmask_first=tuple(map(ScheduleToken.from_json, data["unmask_first"])),
                   unmask_last=tuple(map(ScheduleToken.from_json, data["unmask_last"])))


@dataclass(frozen=True, kw_only=True)
class MlflowRecord:
    """The MLflow run that holds the metrics and the report."""

    tracking_uri: str
    run_id: str

    def to_json(self) -> JsonObject:
        return {"tracking_uri": self.tracking_uri, "run_id": self.run_id}

    @classmethod
    def from_json(cls, data: JsonObject) -> MlflowRecord:
        return cls(tracking_uri=data["tracking_uri"], run_id=data["run_id"])


@dataclass(frozen=True, kw_only=True)
class TrainingRecord:
    """The training's own validation bound, before training (step 0) and at its last validation."""

    untrained_val_nelbo_per_token: float
    final_step: int
    final_val_nelbo_per_token: float
    val_split: str

    KEYS: ClassVar[Keys] = ("untrained_val_nelbo_per_token", "final_step", "final_val_nelbo_per_token", "val_split")

    def to_json(self) -> JsonObject:
        return {key: getattr(self, key) for key in self.KEYS}

    @classmethod
    def from_json(cls, data: JsonObject) -> TrainingRecord:
        return cls(**{key: data[key] for key in cls.KEYS})


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Another evaluation (``unmask eval --compare``) on the datasets both scored."""

    model: ModelRecord
    datasets: dict[str, DatasetResult]
    path: str   # its results.json

    @classmethod
    def missing(cls, data: Any, where: str) -> list[str]:
        """What the JSON object at ``where`` lacks to be a comparison."""
        missing = _lacking(data, where, ("model", "datasets", "path"))
        if isinstance(data, dict) and "model" in data and "datasets" in data:
            missing += ModelRecord.missing(data["model"], f"{where}model.")
            missing += _datasets_missing(data["datasets"], f"{where}datasets.")
        return missing

    def to_json(self) -> JsonObject:
        return {"model": self.model.to_json(),
                "datasets": {name: record.to_json() for name, record in self.datasets.items()},
                "path": self.path}

    @classmethod
    def from_json(cls, data: JsonObject) -> Comparison:
        return cls(model=ModelRecord.from_json(data["model"]), path=data["path"],
                   datasets={name: DatasetResult.from_json(record) for name, record in data["datasets"].items()})


def _training(value: JsonObject | None | Absent) -> TrainingRecord | None | Absent:
    return value if value is None or value is ABSENT else TrainingRecord.from_json(value)


def _datasets_missing(data: Any, where: str) -> list[str]:
    if not isinstance(data, dict):
        return [where.rstrip(".")]
    return [key for name, record in data.items() for key in DatasetResult.missing(record, f"{where}{name}.")]


@dataclass(frozen=True, kw_only=True)
class EvalScores:
    """What ``evaluation.bounds.scoring.evaluate`` measures: the bounds and the protocol."""

    datasets: dict[str, DatasetResult]
    protocol: Protocol


@dataclass(frozen=True, kw_only=True)
class EvalResults:
    """Everything ``unmask eval`` found out and how; written as ``results.json``."""

    model: ModelRecord
    protocol: Protocol
    datasets: dict[str, DatasetResult]
    samples: tuple[SampleRecord, ...]
    mlflow: MlflowRecord | None           # None: not logged (the tracking server was down)
    created: str                          # ISO 8601, UTC
    unmask_version: str
    git_commit: str
    training: TrainingRecord | None | Absent = ABSENT
    comparison: Comparison | Absent = ABSENT
    sampling: SamplingRecord | Absent = ABSENT   # with samples only
    schedule: ScheduleRecord | Absent = ABSENT   # learned-schedule exports only

    REQUIRED: ClassVar[Keys] = ("model", "protocol", "datasets", "samples", "mlflow", "created", "unmask_version",
                                "git_commit")

    def to_json(self) -> JsonObject:
        return _present({
            "model": self.model.to_json(), "protocol": self.protocol.to_json(),
            "datasets": {name: record.to_json() for name, record in self.datasets.items()},
            "samples": [sample.to_json() for sample in self.samples],
            "mlflow": self.mlflow.to_json() if self.mlflow else None,
            "created": self.created, "unmask_version": self.unmask_version, "git_commit": self.git_commit,
            "training": self.training.to_json() if self.training else self.training,
            "comparison": self.comparison.to_json() if self.comparison else ABSENT,
            "sampling": self.sampling.to_json() if self.sampling else ABSENT,
            "schedule": self.schedule.to_json() if self.schedule else ABSENT})

    @classmethod
    def from_json(cls, data: JsonObject) -> EvalResults:
        """Read a results.json object; a ValueError names every key it lacks."""
        _check(cls.missing(data))
        return cls(model=ModelRecord.from_json(data["model"]), protocol=Protocol.from_json(data["protocol"]),
                   datasets={name: DatasetResult.from_json(record) for name, record in data["datasets"].items()},
                   samples=tuple(SampleRecord.from_json(sample) for sample in data["samples"]),
                   mlflow=None if data["mlflow"] is None else MlflowRecord.from_json(data["mlflow"]),
                   created=data["created"], unmask_version=data["unmask_version"], git_commit=data["git_commit"],
                   training=_training(data.get("training", ABSENT)),
                   comparison=Comparison.from_json(data["comparison"]) if "comparison" in data else ABSENT,
                   sampling=SamplingRecord.from_json(data["sampling"]) if "sampling" in data else ABSENT,
                   schedule=ScheduleRecord.from_json(data["schedule"]) if "schedule" in data else ABSENT)

    @classmethod
    def missing(cls, data: Any) -> list[str]:
        """Every key that ``data`` lacks to be read as results, by its dotted name."""
        missing = _lacking(data, "", cls.REQUIRED)
        if not isinstance(data, dict):
            return missing
        if "model" in data:
            missing += ModelRecord.missing(data["model"], "model.")
        if "protocol" in data:
            missing += _lacking(data["protocol"], "protocol.", Protocol.REQUIRED)
        if "datasets" in data:
            missing += _datasets_missing(data["datasets"], "datasets.")
        for index, sample in enumerate(data.get("samples") or []):
            missing += _lacking(sample, f"samples.{index}.", SampleRecord.KEYS)
        if isinstance(data.get("mlflow"), dict):
            missing += _lacking(data["mlflow"], "mlflow.", ("tracking_uri", "run_id"))
        if isinstance(data.get("training"), dict):
            missing += _lacking(data["training"], "training.", TrainingRecord.KEYS)
        if "comparison" in data:
            missing += Comparison.missing(data["comparison"], "comparison.")
        if "schedule" in data:
            missing += _lacking(data["schedule"], "schedule.", ScheduleRecord.KEYS)
            orders = data["schedule"] if isinstance(data["schedule"], dict) else {}
            for order in ("unmask_first", "unmask_last"):
                for index, entry in enumerate(orders.get(order) or []):
                    missing += _lacking(entry, f"schedule.{order}.{index}.", ScheduleToken.KEYS)
        if "sampling" in data:
            missing += _lacking(data["sampling"], "sampling.", SamplingRecord.KEYS)
            sampling = data["sampling"] if isinstance(data["sampling"], dict) else {}
            if "generative_perplexity" in sampling:
                missing += _lacking(sampling["generative_perplexity"], "sampling.generative_perplexity.",
                                    GenerativePerplexity.KEYS)
            for index, row in enumerate(sampling.get("sweep") or []):
                missing += _lacking(row, f"sampling.sweep.{index}.", SweepRow.KEYS)
        return missing

    def dumps(self) -> str:
        """The text of results.json: indented, keys sorted, UTF-8 as is."""
        return json.dumps(self.to_json(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def read(cls, path: Path) -> EvalResults:
        """A results.json file; ValueError when it is not one (OSError when it cannot be read)."""
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
