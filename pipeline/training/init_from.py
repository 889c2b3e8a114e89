"""Starting a new run from another run's weights (``unmask train --init-from SOURCE``).

SOURCE is an export or a training run directory (its newest intact checkpoint's EMA weights,
or with ``weights="model"`` the live ones), or a Hugging Face causal LM directory
(``pipeline.interchange.causal_lm_import``). The new run has a config of its own; only its
network must have the source's tensors, name for name and shape for shape, and what no config
field sets is the source's (``SOURCE_ARCHITECTURE``). A Hugging Face model's network, and that of
an autoregressive source a diffusion run adapts (``pipeline.training.adaptation``), is the
source's whole (``source_network``). The weights are loaded before DeepSpeed wraps the module
(``load_source``), so every ZeRO stage partitions them; the source is recorded (``InitRecord``)
in every checkpoint. A run that has checkpoints resumes from its own and never reloads the
source (``starting_point``); asking it for another source is refused. The manual:
docs/training.md#starting-from-another-runs-weights-init-from, docs/adapting.md.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from common.errors import UserError
from common.file_records import sha256_file
from common.outputs import InputPath
from model.spec import ModelSpec
from model.transformer import TransformerConfig, unpadded_state
from pipeline.config import Config
from pipeline.interchange.causal_lm_import import is_hugging_face_model, read_causal_lm
from pipeline.interchange.export import CONFIG_FILE, TOKENIZER_DIR, WEIGHTS_FILE, canonical_name, checkpoint_tensors
from pipeline.run_dir.checkpoint import STATE_FILE, CheckpointMeta, EarlierCheckpoint, intact_checkpoint, read_state
from pipeline.run_dir.layout import TAG_PATTERN, RunLayout
from pipeline.training.adaptation import (
    adaptation_record,
    adapted_network,
    adapted_tensors,
    check_adaptable,
    check_not_adapting,
    is_adaptation,
)

__all__ = [
    "SOURCE_ARCHITECTURE",
    "InitFrom",
    "InitRecord",
    "InitSource",
    "InitWeights",
    "adapted_source",
    "check_tokenizer",
    "init_inputs",
    "load_source",
    "read_source",
    "recorded_source",
    "source_network",
    "starting_point",
    "with_source_architecture",
]

log = logging.getLogger("unmask.train")


InitWeights = Literal["ema", "model"]
# TransformerConfig fields that no config field sets (model.transformer's options for exact
# imports, and the widths a preset fixes): a run started from a source takes the source's.
SOURCE_ARCHITECTURE = ("mlp_ratio", "time_embed_dim", "tie_weights", "rope_base", "norm_eps", "init_std",
                       "mlp_bias", "head_bias", "head_mask_row", "adaptive_norm", "time_frequencies", "time_input",
                       "rope_angles", "shift", "family")
# The model section's shape fields: a source's network whole must agree with those a config sets.
SHAPE_FIELDS = ("n_layers", "d_model", "n_heads")


@dataclass(frozen=True)
class InitFrom:
    """The weights a new run starts from: ``path`` is an export directory or a training run
    directory; ``weights`` chooses a run's EMA (None: the default) or live weights ("model");
    an export holds one set and takes None."""

    path: str | Path
    weights: InitWeights | None = None


@dataclass(frozen=True)
class InitRecord:
    """The provenance of a run's first weights, as checkpoints record it."""

    source: str                  # the export, run or Hugging Face model directory, absolute
    kind: Literal["export", "run", "hf"]
    weights: str                 # "ema", "model", an import's "published", a Hugging Face model's "pretrained"
    file: str                    # the file ``sha256`` is of: the export's weights, the checkpoint's state file,
                                 # a Hugging Face model's weights (or its shards' index)
    sha256: str
    step: int | None             # the source's training step (None: not known, an import's)
    config_sha256: str | None    # of the source run's config (None: an import, a Hugging Face model)
    tokenizer_sha256: str
    network: dict                # the source's TransformerConfig fields, without vocabulary padding
    family: str | None = None    # a Hugging Face model's model_type (gpt2, llama, qwen2); None: unmask's
    start_token: int | None = None  # a Hugging Face model's token whose embedding is the start row (BOS, else EOS)
    adaptation: dict | None = None  # what adapting an autoregressive source did (AdaptationRecord); None: no adaptation

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> InitRecord:
        return cls(**{f.name: record.get(f.name) for f in fields(cls)})

    @property
    def tokenizer_dir(self) -> Path:
        """Where the source keeps its tokenizer (an export's, the run's, a Hugging Face model's own directory)."""
        if self.kind == "hf":
            return Path(self.source)
        return Path(self.source) / (TOKENIZER_DIR if self.kind == "export" else RunLayout(self.source).tokenizer.name)

    def summary(self) -> str:
        if self.kind == "hf":
            return f"Hugging Face {self.family} model {self.source} ({self.file} sha256 {self.sha256[:12]}...)"
        step = f" step {self.step}" if self.step is not None else ""
        return f"{self.kind} {self.source} ({self.weights} weights{step}, sha256 {self.sha256[:12]}...)"


@dataclass(frozen=True)
class InitSource:
    """A source read for loading: its record and its tensors (export names, no padding)."""

    record: InitRecord
    tensors: dict[str, torch.Tensor]


def init_inputs(init: InitFrom | None) -> list[InputPath]:
    """The source as an input the new run directory keeps clear of (``common.outputs``)."""
    return [] if init is None else [InputPath(init.path, "--init-from")]


def read_source(init: InitFrom) -> InitSource:
    """The record and weights of ``init``'s source; one-line errors for a path that does not
    exist or is neither an export nor a run with an intact checkpoint."""
    path = Path(init.path)
    if init.weights not in (None, "ema", "model"):
        raise UserError(f"--init-weights must be 'ema' or 'model', got {init.weights!r}")
    if not path.exists():
        raise UserError(f"--init-from {path}: does not exist; give an export (`unmask export`, `unmask import`) "
                        f"or a training run directory")
    if RunLayout(path).is_training_run():
        return _read_run(path, init.weights or "ema")
    if is_hugging_face_model(path):
        if init.weights is not None:
            raise UserError(f"--init-from {path}: a Hugging Face model holds one set of weights; --init-weights "
                            f"chooses between the EMA and the live weights of a run directory")
        return _read_hugging_face(path)
    if (path / WEIGHTS_FILE).is_file() and (path / CONFIG_FILE).is_file():
        if init.weights is not None:
            raise UserError(f"--init-from {path}: an export holds one set of weights; --init-weights chooses "
                            f"between the EMA and the live weights of a run directory")
        return _read_export(path)
    raise UserError(f"--init-from {path}: neither an export (no {WEIGHTS_FILE} and {CONFIG_FILE}), a training run "
                    f"(no {RunLayout(path).checkpoints.name}/) nor a Hugging Face model (its {CONFIG_FILE}); give RUN, "
                    f"RUN/export, an `unmask import` --out or a Hugging Face causal LM directory")


def _read_hugging_face(path: Path) -> InitSource:
    """A Hugging Face causal LM, as the autoregressive network it computes (start row V)."""
    model = read_causal_lm(path)
    record = InitRecord(source=str(path.resolve()), kind="hf", weights="pretrained", file=model.weights_file,
                        sha256=model.weights_sha256, step=None, config_sha256=None,
                        tokenizer_sha256=model.tokenizer.sha256, network=asdict(model.network), family=model.family,
                        start_token=model.start_token)
    return InitSource(record, model.tensors)


def _read_export(path: Path) -> InitSource:
    config_path = path / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        network = ModelSpec.from_dict(config).network
        tokenizer_sha256 = config["tokenizer_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"--init-from {config_path}: not an unmask export's config ({type(err).__name__}: "
                        f"{err}); export the run again") from None
    weights_path = path / WEIGHTS_FILE
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as err:
        raise UserError(f"--init-from {weights_path}: not a readable safetensors file ({err})") from None
    record = InitRecord(source=str(path.resolve()), kind="export", weights=str(config.get("weights", "ema")),
                        file=WEIGHTS_FILE, sha256=sha256_file(weights_path), step=config.get("step"),
                        config_sha256=config.get("config_sha256"), tokenizer_sha256=tokenizer_sha256,
                        network=asdict(network))
    return InitSource(record, {name: t.float() for name, t in tensors.items()})


def _read_run(path: Path, weights: InitWeights) -> InitSource:
    checkpoint, broken = intact_checkpoint(path)
    if checkpoint is None:
        why = f"no intact checkpoint ({'; '.join(broken)})" if broken else "no checkpoint yet"
        raise UserError(f"--init-from {path}: a training run with {why}; train it (or restore its checkpoints) "
                        f"first, or give its export")
    state = read_state(checkpoint)
    tensors, spec = checkpoint_tensors(checkpoint, weights)
    record = InitRecord(source=str(path.resolve()), kind="run", weights=weights,
                        file=f"{RunLayout(path).checkpoints.name}/{checkpoint.name}/{STATE_FILE}",
                        sha256=sha256_file(checkpoint / STATE_FILE), step=state.step, config_sha256=state.config_sha256,
                        tokenizer_sha256=state.tokenizer_sha256, network=asdict(spec.network))
    return InitSource(record, tensors)


def recorded_source(run_dir: Path, init: InitFrom | None) -> InitRecord | None:
    """The source recorded in ``run_dir``'s latest checkpoint (None: no checkpoint, or a run
    from scratch). ``init`` (this call's --init-from) must name that source: a run with
    checkpoints resumes from its own, and another source (or one for a run from scratch) is
    refused."""
    saved = _newest_state(RunLayout(run_dir))
    if saved is None:
        return None
    record = InitRecord.from_json(saved.init_from) if saved.init_from else None
    if init is None:
        return record
    asked = str(Path(init.path).resolve())
    if record is None:
        raise UserError(f"--init-from {init.path}: {run_dir} already has checkpoints of a run started from scratch "
                        f"(latest step {saved.step}); --init-from starts a new run: choose a new --run-dir")
    if asked != record.source or init.weights not in (None, record.weights):
        raise UserError(f"--init-from {init.path}: {run_dir} was started from {record.summary()} and has "
                        f"checkpoints (latest step {saved.step}); resume it with that --init-from (or none), or "
                        f"start the new source in a new --run-dir")
    return record


def _newest_state(layout: RunLayout) -> CheckpointMeta | None:
    """The state of the newest checkpoint whose state file reads (every checkpoint of a run
    records the same source; resuming verifies the one it takes)."""
    if not layout.checkpoints.is_dir():
        return None
    for directory in sorted((d for d in layout.checkpoints.iterdir() if TAG_PATTERN.match(d.name)), reverse=True):
        try:
            return read_state(directory)
        except EarlierCheckpoint:
            raise
        except UserError:  # half-written or corrupt: an earlier one says the same
            continue
    return None


def starting_point(run_dir: Path, init_from: InitFrom | None, is_main: bool) -> InitRecord | InitSource | None:
    """What a run's network starts from: with checkpoints, the record of the source its
    checkpoint names (its weights come from the checkpoint; ``recorded_source`` refuses another
    source); without, ``init_from``'s source, read on every rank (each builds its own module)."""
    recorded = recorded_source(run_dir, init_from)
    if recorded is not None or init_from is None:
        if recorded is not None and init_from is not None and is_main:
            log.info("%s has checkpoints: resuming from its own, not reloading --init-from %s", run_dir,
                     recorded.source)
        return recorded
    source = read_source(init_from)
    if is_main:
        log.info("starting from the %s; optimizer state fresh, EMA from these weights", source.record.summary())
    return source


def with_source_architecture(network: TransformerConfig, record: InitRecord) -> TransformerConfig:
    """``network`` (the config's) with the source's ``SOURCE_ARCHITECTURE`` options."""
    source = record.network
    return replace(network, **{name: source[name] for name in SOURCE_ARCHITECTURE if name in source})


def source_network(network: TransformerConfig, record: InitRecord, config: Config) -> TransformerConfig:
    """The network of a run of ``config`` started from ``record``'s source, given the one the
    config and data make (``network``): adapted from a causal source into a diffusion run, the
    Hugging Face model's whole at the run's context, or ``with_source_architecture``."""
    adapting = is_adaptation(record.network, config)
    if not adapting:
        check_not_adapting(config.adapt)
    if not adapting and record.kind != "hf":
        return with_source_architecture(network, record)
    source = TransformerConfig(**record.network)
    _check_shape(config, source, record)
    try:
        if adapting:
            check_adaptable(config, record.summary())
            return adapted_network(source, network, config.adapt.shift)
        return replace(source, max_seq_len=network.max_seq_len, dropout=network.dropout,
                       vocab_multiple=network.vocab_multiple, causal=network.causal,
                       time_conditioning=network.time_conditioning)
    except ValueError as err:
        raise UserError(f"--init-from {record.source}: its network cannot run this config ({err})") from None


def _check_shape(config: Config, source: TransformerConfig, record: InitRecord) -> None:
    """A source whose network a run takes whole: the shape fields a config sets must be its."""
    for name in SHAPE_FIELDS:
        value = getattr(config.model, name)
        if value is not None and value != getattr(source, name):
            raise UserError(f"config field model.{name} = {value}: the run takes its network from {record.summary()}, "
                            f"whose {name} is {getattr(source, name)}; leave model.{name} unset")


def adapted_source(source: InitSource, network: TransformerConfig, config: Config) -> InitSource:
    """An autoregressive source laid out for its adapted ``network``, its record saying how."""
    causal = TransformerConfig(**source.record.network)
    start = (f"the embedding of token {source.record.start_token}" if source.record.start_token is not None
             else "the source's start row")
    record = replace(source.record, adaptation=adaptation_record(config, causal, network, start).to_json())
    return InitSource(record, adapted_tensors(source.tensors, causal, network))


def check_tokenizer(record: InitRecord, tokenizer_sha256: str, data_dir: Path) -> None:
    """The new run's data must be tokenized as the source's (its embedding rows are token ids)."""
    if record.tokenizer_sha256 != tokenizer_sha256:
        raise UserError(f"--init-from {record.source}: its tokenizer (sha256 {record.tokenizer_sha256[:12]}...) is "
                        f"not the one {data_dir} was prepared with ({tokenizer_sha256[:12]}...); prepare the data "
                        f"with the source's: `unmask prep --tokenizer {record.tokenizer_dir} ...` (`unmask run "
                        f"--tokenizer {record.tokenizer_dir}`)")


def load_source(model: nn.Module, source: InitSource, network: TransformerConfig) -> None:
    """Copy the source's tensors into ``model`` (a network of ``network``, or a
    ``NetworkWithSchedule``), in place; each must exist in both with one
    shape (a learned schedule's ``schedule.theta`` too). Vocabulary padding rows stay zero."""
    targets = {canonical_name(name): tensor for name, tensor in model.state_dict().items()}
    ours, theirs = unpadded_state(targets, network), source.tensors  # ours: views of each tensor's true rows
    for name in [*ours, *(name for name in theirs if name not in ours)]:
        mine, other = ours.get(name), theirs.get(name)
        if mine is None or other is None or mine.shape != other.shape:
            raise UserError(f"--init-from {source.record.source}: the network differs from this config's: {name} is "
                            f"{_shape(other)} in the source and {_shape(mine)} here; set model.n_layers, d_model, "
                            f"n_heads, time_conditioning and objective as the source has them")
    with torch.no_grad():
        for name, mine in ours.items():
            if name in theirs:
                targets[name].zero_()  # padding rows past the true ones
                mine.copy_(theirs[name])


def _shape(tensor: torch.Tensor | None) -> str:
    return "absent" if tensor is None else str(list(tensor.shape))
