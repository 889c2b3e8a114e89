"""The one spec a model is built from: its network and the process it is trained under.

An export's ``config.json`` holds it (``to_dict``; ``from_dict`` refuses a record without
every key), and training, evaluation and sampling all build from it, so a model is always
scored and sampled under the process it was trained with. ``objective="diffusion"`` takes a
``process``: ``"absorbing"`` (``AbsorbingDiffusion``; with ``block_size``, ``BlockDiffusion``),
``"uniform"`` (``UniformDiffusion``) or ``"learned"`` (``LearnedDiffusion``, whose schedule is
``"learned"``, with ``LearnedSchedule``'s arguments); the others name a ``make_schedule``
schedule. ``objective="autoregressive"`` is the causal baseline. ``build_trainable`` builds
what a trainer optimizes (the network, or a ``NetworkWithSchedule``). The guide:
docs/model-api.md#modelspec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, get_args

from torch import Tensor

from model.absorbing import AbsorbingDiffusion
from model.autoregressive import Autoregressive
from model.block_attention import BlockAttention
from model.block_diffusion import BlockDiffusion
from model.learned import DEFAULT_DRAWS, LearnedDiffusion, LearnedSchedule
from model.process import DiffusionProcess
from model.schedules import check_schedule_arguments, make_schedule
from model.trainable import NetworkWithSchedule
from model.transformer import Transformer, TransformerConfig
from model.uniform import UniformDiffusion

__all__ = ["LEARNED_SCHEDULE", "PROCESS_TYPES", "SPEC_KEYS", "ModelSpec", "ObjectiveKind", "Process", "ProcessKind",
           "build_network", "build_process", "build_trainable"]

ObjectiveKind = Literal["diffusion", "autoregressive"]
ProcessKind = Literal["absorbing", "uniform", "learned"]
# What ``build_process`` returns: the autoregressive baseline is the "process" of its objective.
Process = DiffusionProcess | Autoregressive
# The schedule name of the learned process (GenMD4's per-token schedule, not a make_schedule one).
LEARNED_SCHEDULE = "learned"
# The keys of a spec's record (``to_dict``), all required; ``block_size`` is written for block diffusion only.
SPEC_KEYS = ("network", "objective", "process", "schedule", "schedule_args")
# The class of each diffusion process: what a config's process kind samples with, before any process is built.
PROCESS_TYPES: dict[str, type[DiffusionProcess]] = {"absorbing": AbsorbingDiffusion, "uniform": UniformDiffusion,
                                                    "learned": LearnedDiffusion}


@dataclass(frozen=True)
class ModelSpec:
    """A model: its network and the objective, process and schedule it is trained under."""

    network: TransformerConfig
    objective: ObjectiveKind = "diffusion"
    process: ProcessKind = "absorbing"       # the diffusion process (objective "diffusion")
    schedule: str = "linear"                 # make_schedule name, or "learned" for process "learned"
    schedule_args: dict[str, Any] = field(default_factory=dict)
    block_size: int | None = None            # block diffusion's L' (model.block_diffusion); None: MDLM

    def __post_init__(self) -> None:
        _check_kind("objective", self.objective, ObjectiveKind)
        _check_kind("process", self.process, ProcessKind)
        _check_block_size(self.block_size, self.network.max_seq_len)
        if self.block_size is not None and (self.objective, self.process) != ("diffusion", "absorbing"):
            raise ValueError(f"ModelSpec: block_size applies to the absorbing diffusion only, not to "
                             f"{self.process if self.objective == 'diffusion' else self.objective!r}")
        if (self.process == "learned") != (self.schedule == LEARNED_SCHEDULE):
            raise ValueError(f"ModelSpec: the learned process takes schedule {LEARNED_SCHEDULE!r} and no other "
                             f"process does; got process {self.process!r} with schedule {self.schedule!r}")

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-ready keys (those of an export's config.json)."""
        record = {"network": asdict(self.network), "objective": self.objective, "process": self.process,
                  "schedule": self.schedule, "schedule_args": dict(self.schedule_args)}
        if self.block_size is not None:  # block diffusion's records only
            record["block_size"] = self.block_size
        return record

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> ModelSpec:
        """The spec in ``record`` (a config.json, which holds other keys too). It must hold every
        key ``to_dict`` writes and every field of the network; ValueError naming the first one
        missing, or a network field this version does not know (an export of another version)."""
        missing = [key for key in SPEC_KEYS if key not in record]
        if not missing:
            missing = [f"network.{f.name}" for f in fields(TransformerConfig) if f.name not in record["network"]]
        unknown = [] if missing else sorted(set(record["network"]) - {f.name for f in fields(TransformerConfig)})
        if missing or unknown:
            problem = (f"no key {missing[0]!r}" if missing
                       else f"a network field this unmask does not know, {unknown[0]!r}")
            raise ValueError(f"the model spec has {problem}: written by another version of unmask; export (or "
                             f"import) the model again with this one")
        present = {f.name: record[f.name] for f in fields(cls) if f.name != "network" and f.name in record}
        try:
            return cls(network=TransformerConfig(**record["network"]), **present)
        except ValueError as err:  # what the writer never writes: a record changed since
            raise ValueError(f"{err}; restore the value it was written with, or export (or import) the model "
                             f"again") from None


def _check_block_size(block_size: Any, max_seq_len: int) -> None:
    """Block diffusion's rules, as training and the imports apply them: an integer >= 1 that
    divides the network's window (its blocks are scored and sampled whole)."""
    if block_size is None:
        return
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1 (null: one block, MDLM), got {block_size!r}")
    if max_seq_len % block_size:
        raise ValueError(f"block_size {block_size} does not divide network.max_seq_len {max_seq_len}: a block "
                         f"diffusion model scores and samples whole blocks of its window")


def _check_kind(name: str, value: str, kind: Any) -> None:
    if value not in get_args(kind):
        raise ValueError(f"ModelSpec.{name} must be one of {get_args(kind)}, got {value!r}")


def build_network(spec: ModelSpec, *, block_attention: BlockAttention = "dense") -> Transformer:
    """The network of ``spec``, freshly initialised (from the global RNG); ``block_attention``:
    the form of block diffusion's training mask (``Transformer``)."""
    return Transformer(spec.network, block_attention)


def build_process(spec: ModelSpec, *, validate: bool = True, cross_entropy_chunk_rows: int = 0,
                  draws: int = DEFAULT_DRAWS, state: Mapping[str, Tensor] | None = None) -> Process:
    """The process (or the autoregressive baseline) of ``spec`` over its network's vocabulary.

    ``validate`` (default True) checks token ids and times on every call, which synchronizes
    a GPU with the host: a trainer or evaluator fed by validated shards turns it off.
    ``cross_entropy_chunk_rows`` > 0 is the absorbing process's alone (``AbsorbingDiffusion``):
    the others score the full [N, V] prediction, so they refuse it. ``draws`` (K) and
    ``state`` are the learned process's: K draws of z_t per sequence (``LearnedDiffusion``;
    1 to score without a gradient), and the trained parameters of its schedule
    (``LearnedSchedule.state_dict()``, e.g. an export's; None: the initial ones).
    """
    vocab_size = spec.network.vocab_size
    if cross_entropy_chunk_rows and (spec.objective, spec.process) != ("diffusion", "absorbing"):
        raise ValueError(f"cross_entropy_chunk_rows applies to the absorbing process only, not to "
                         f"{spec.process if spec.objective == 'diffusion' else spec.objective!r}")
    if state and spec.process != "learned":
        raise ValueError(f"the {spec.process} process has no parameters, got a state with {sorted(state)}")
    if spec.objective == "autoregressive":
        return Autoregressive(vocab_size, validate=validate)
    if spec.process == "learned":
        check_schedule_arguments(LEARNED_SCHEDULE, LearnedSchedule, spec.schedule_args, fixed=("vocab_size",))
        try:
            schedule = LearnedSchedule(vocab_size, **spec.schedule_args)
        except TypeError as err:
            raise ValueError(f"bad arguments for schedule {LEARNED_SCHEDULE!r}: {err}") from None
        if state is not None:
            try:
                schedule.load_state_dict(state)
            except RuntimeError as err:  # names missing, unexpected or mis-shaped tensors
                raise ValueError(f"bad state for schedule {LEARNED_SCHEDULE!r}: {err}") from None
        return LearnedDiffusion(schedule, vocab_size, draws=draws, validate=validate)
    if spec.process == "uniform":
        return UniformDiffusion(make_schedule(spec.schedule, **spec.schedule_args), vocab_size, validate=validate)
    schedule = make_schedule(spec.schedule, **spec.schedule_args)
    if spec.block_size is not None:
        return BlockDiffusion(schedule, vocab_size, spec.block_size, validate=validate,
                              cross_entropy_chunk_rows=cross_entropy_chunk_rows)
    return AbsorbingDiffusion(schedule, vocab_size, validate=validate,
                              cross_entropy_chunk_rows=cross_entropy_chunk_rows)


def build_trainable(spec: ModelSpec, *, validate: bool = True,
                    block_attention: BlockAttention = "dense") -> Transformer | NetworkWithSchedule:
    """What a trainer optimizes for ``spec``, freshly initialised (the network from the global
    RNG): the network, or for the learned process a ``NetworkWithSchedule`` of the network and the
    process (training's ``DEFAULT_DRAWS`` draws), whose forward is the bound."""
    network = build_network(spec, block_attention=block_attention)
    if spec.objective == "diffusion" and spec.process == "learned":
        return NetworkWithSchedule(network, build_process(spec, validate=validate))
    return network
