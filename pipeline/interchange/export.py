"""Export: a checkpoint's EMA weights as one ``model.safetensors``, loadable without DeepSpeed.

    RUN/export/model.safetensors   float32 EMA weights, gathered from any ZeRO stage: the network's,
                                   and a learned schedule's as ``schedule.theta``
    RUN/export/config.json         the model's spec (network shape, objective, process, schedule),
                                   provenance, and ``format_version`` (``EXPORT_FORMAT_VERSION``)
    RUN/export/tokenizer/          the tokenizer the model was trained with

``weights="model"`` exports the live weights instead, through DeepSpeed's ZeRO-to-fp32
conversion; ``format="hf"`` and ``export_to_hf`` write a transformers directory
(``pipeline.interchange.hf_export``). An export directory appears whole and replaces only an
earlier export (``EXPORT_KIND``, ``common.outputs``). ``load_export`` checks the files against
the sizes and sha256 its marker records before reading anything (``verify_export``), and
refuses a damaged export, or one of another format, in one line with the fix. The manual:
docs/import-export.md.
"""

from __future__ import annotations

import json
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from common.atomic_files import atomic_write_bytes
from common.errors import UserError
from common.file_records import FileRecord, changed_files, resized_files, sha256_file, tree_files
from common.outputs import (
    MARKER,
    InputPath,
    OutputKind,
    check_output_dir,
    marker_problem,
    new_output_dir,
    read_marker,
)
from data_prep.tokenizer.base import Tokenizer
from data_prep.tokenizer.gpt2_bpe import GPT2_ENCODER_FILE, GPT2_MERGES_FILE
from data_prep.tokenizer.hugging_face import SPECIAL_TOKENS_MAP_FILE, TOKENIZER_JSON_FILE
from data_prep.tokenizer.load import load_tokenizer
from data_prep.tokenizer.sentencepiece_model import SP_MODEL_FILE
from model.spec import ModelSpec, Process, build_network, build_process, build_trainable
from model.trainable import NETWORK_PREFIX, split_state
from model.transformer import Transformer, TransformerConfig, unpadded_state
from pipeline.config import DistillSection, ModelSection
from pipeline.interchange.hf_export import HF_EXPORT_KIND, write_hf_export
from pipeline.run_dir.checkpoint import (
    STATE_FILE,
    CheckpointMeta,
    intact_checkpoint,
    read_state,
    resolve_checkpoint,
    verify_checkpoint,
)
from pipeline.run_dir.layout import RUN_KIND, RunLayout
from pipeline.run_dir.rank_files import rank_file, whole_ema
from pipeline.run_dir.safe_load import deepspeed_loads_safely, find_unloadable

__all__ = ["export", "export_checkpoint", "checkpoint_tensors", "checkpoint_sha256", "has_ema", "resolve_export",
           "training_run_of", "enclosing_run", "check_outside_runs", "write_export", "load_export", "Exported",
           "canonical_name", "export_to_hf", "export_directory", "export_files", "ExportFormat", "EXPORT_KIND",
           "EXPORT_FORMAT_VERSION", "WEIGHTS_FILE", "CONFIG_FILE", "TOKENIZER_DIR", "damaged_export",
           "read_export_spec", "verify_export"]

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"  # inside an export: the tokenizer the model was trained with
EXPORT_FORMAT_VERSION = 1
# unmask's own directory (load_export), or transformers' (pipeline.interchange.hf_export).
ExportFormat = Literal["unmask", "hf"]
# How long export waits for a tracking server that does not answer (it only adds an artifact).
TRACKING_WAIT_S = 5.0
log = logging.getLogger("unmask.export")
# Activation checkpointing wraps blocks; their parameter names gain this component.
_WRAPPER_PREFIX = "_checkpoint_wrapped_module."
# Draws of z_t per sequence of a learned process built from an export: scoring takes no
# gradient, and the second draw of training only serves the gradient's baseline.
EXPORT_DRAWS = 1


# The files a tokenizer of any kind saves (``Tokenizer.save``), as an export's tokenizer/ holds them.
_TOKENIZER_FILES = frozenset({SP_MODEL_FILE, TOKENIZER_JSON_FILE, SPECIAL_TOKENS_MAP_FILE, GPT2_ENCODER_FILE,
                              GPT2_MERGES_FILE})


def _unmarked_export(directory: Path) -> list[str] | None:
    """The files beside the export in ``directory``, which has no marker (an earlier unmask's
    export, or one copied without it); None when it holds no export (no weights and config)."""
    if not ((directory / WEIGHTS_FILE).is_file() and (directory / CONFIG_FILE).is_file()):
        return None
    ours = lambda name: name in (WEIGHTS_FILE, CONFIG_FILE) or (
        name.startswith(f"{TOKENIZER_DIR}/") and name.removeprefix(f"{TOKENIZER_DIR}/") in _TOKENIZER_FILES)
    return [name for name in tree_files(directory, skip=(MARKER,)) if not ours(name)]


# What `unmask export` and `unmask import` write: a directory that appears whole.
EXPORT_KIND = OutputKind("export", "an unmask export", whole=True, unmarked_copy=_unmarked_export)


def canonical_name(name: str) -> str:
    """A parameter's name in the export: in the plain ``Transformer`` (without DeepSpeed,
    wrapper or ``NetworkWithSchedule`` prefixes), or ``schedule.*`` for a learned schedule's."""
    return name.replace(_WRAPPER_PREFIX, "").removeprefix(NETWORK_PREFIX)


def has_ema(checkpoint: Path) -> bool:
    """Whether a checkpoint holds the EMA (every rank's file is there)."""
    state = read_state(checkpoint)
    return all(rank_file(checkpoint, rank).is_file() for rank in range(state.world_size))


def _ema_weights(checkpoint: Path, world_size: int) -> dict[str, torch.Tensor]:
    return whole_ema([rank_file(checkpoint, rank) for rank in range(world_size)])[0]


def _model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        with deepspeed_loads_safely():
            return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
    except Exception as err:  # DeepSpeed does not say which file it was reading
        culprit = find_unloadable(checkpoint)
        if culprit is not None:
            raise culprit from None
        raise UserError(f"{checkpoint}: DeepSpeed could not read its ZeRO files ({type(err).__name__}: {err})") \
            from err


def export(run_dir: str | Path, *, step: int | None = None, weights: Literal["ema", "model"] = "ema",
           out_dir: str | Path | None = None, format: ExportFormat = "unmask") -> Path:
    """Write the export of checkpoint ``step`` (latest: None); returns the export directory.
    ``format="hf"`` writes the transformers directory of ``pipeline.interchange.hf_export`` instead
    (default ``RUN/export-hf``)."""
    run_dir = Path(run_dir)
    if weights not in ("ema", "model"):
        raise UserError(f"--weights must be 'ema' or 'model', got {weights!r}")
    out = _check_out(run_dir, out_dir, format)
    checkpoint = resolve_checkpoint(run_dir, step)
    problem = verify_checkpoint(checkpoint)
    if problem is not None:
        intact, _ = intact_checkpoint(run_dir)
        fix = (f"export the newest intact one: `unmask export {run_dir} --checkpoint {read_state(intact).step}`"
               if intact else "no intact checkpoint is left")
        raise UserError(f"cannot export {checkpoint.name}: {problem}; {fix}")
    return _write(run_dir, checkpoint, weights, out, format)


def _check_out(run_dir: Path, out_dir: str | Path | None, format: ExportFormat, flag: str = "--out") -> Path:
    """The export's directory (given, or the run's), checked before any work: an unmask export
    inside another training run would be taken for that run's (``training_run_of``). ``flag``
    names it in a refusal."""
    if format not in ("unmask", "hf"):
        raise UserError(f"--format must be 'unmask' or 'hf', got {format!r}")
    layout = RunLayout(run_dir)
    out = Path(out_dir) if out_dir is not None else layout.hf_export if format == "hf" else layout.export
    check_output_dir(out, HF_EXPORT_KIND if format == "hf" else EXPORT_KIND, flag,
                     [InputPath(layout.checkpoints, "the checkpoints it exports"),
                      InputPath(layout.tokenizer, "the run's tokenizer")])
    if format == "unmask":
        check_outside_runs(out, flag, besides=run_dir)
    return out


def export_checkpoint(run_dir: Path, checkpoint: Path, *, weights: Literal["ema", "model"], flag: str) -> Path:
    """``export`` of ``checkpoint`` into ``RUN/export``, a checkpoint of ``run_dir`` the caller has
    verified (``verify_checkpoint``: hashing it again would cost as much as the export), for a
    command that was not given that directory: ``flag`` says what it is in a refusal."""
    return _write(run_dir, checkpoint, weights, _check_out(run_dir, None, "unmask", flag), "unmask")


def _write(run_dir: Path, checkpoint: Path, weights: Literal["ema", "model"], out: Path, format: ExportFormat) -> Path:
    state = read_state(checkpoint)
    tensors, spec = checkpoint_tensors(checkpoint, weights)
    tokenizer_src = RunLayout(run_dir).tokenizer
    if not tokenizer_src.is_dir():
        raise UserError(f"{run_dir}: no {tokenizer_src.name}/ directory (written when training starts)")
    writer = write_hf_export if format == "hf" else write_export
    writer(out, tensors, _export_config(spec, state, checkpoint, weights), tokenizer_src)
    _track(run_dir, out)
    return out


def checkpoint_sha256(checkpoint: Path) -> str:
    """What names a checkpoint wherever its run is moved: the sha256 of its state file, which
    records the size and sha256 of every other file of it (an export's ``checkpoint_sha256``)."""
    return sha256_file(checkpoint / STATE_FILE)


def enclosing_run(path: str | Path) -> Path | None:
    """The training run ``path`` lies inside (its parent a run directory, or any directory above
    it marked as a run), or None."""
    here = Path(path).expanduser()
    if RunLayout(here.parent).is_training_run():
        return here.parent
    return next((above for above in here.absolute().parents if (read_marker(above) or {}).get("kind") == RUN_KIND.name),
                None)


def check_outside_runs(out: str | Path, flag: str, *, besides: Path | None = None) -> None:
    """Refuse, in one line, an export directory inside a training run (other than ``besides``,
    the run it exports): a command given that run would take the model for the run's own."""
    run = enclosing_run(out)
    if run is None or (besides is not None and run.resolve() == Path(besides).resolve()):
        return
    raise UserError(f"{flag} {out}: lies inside the training run {run}, where an export is taken for that run's own "
                    f"model (`unmask eval {run}` would report it as the run's); choose a directory outside it")


def checkpoint_tensors(checkpoint: Path, weights: Literal["ema", "model"]) -> tuple[dict[str, torch.Tensor],
                                                                                   ModelSpec]:
    """The float32 weights of ``checkpoint`` (its EMA, or its live weights through DeepSpeed's
    ZeRO-to-fp32) by their export names, without vocabulary padding, and the spec they fit:
    what an export holds (``--init-from`` also starts a run from them)."""
    state = read_state(checkpoint)
    raw = _ema_weights(checkpoint, state.world_size) if weights == "ema" else _model_weights(checkpoint)
    spec = ModelSection(**state.config["model"]).spec(TransformerConfig(**state.network))
    tensors = {canonical_name(name): t.float().contiguous() for name, t in raw.items()}
    _check_complete(tensors, spec, checkpoint)
    return _unpadded(tensors, spec)


def write_export(out: Path, tensors: dict[str, torch.Tensor], config: dict, tokenizer_dir: Path) -> None:
    """Write the export directory ``out``; it appears whole or not at all, and replaces only
    an earlier export (``common.outputs.new_output_dir``)."""
    with new_output_dir(out, EXPORT_KIND, "--out") as staging:
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt", "weights": config["weights"]})
        shutil.copytree(tokenizer_dir, staging / TOKENIZER_DIR)
        atomic_write_bytes(staging / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True).encode())


def export_directory(path: str | Path) -> Path:
    """The export directory that ``path`` names (an export, or a training run's ``RUN/export``),
    for an output that must keep clear of it; nothing is read."""
    layout = RunLayout(path)
    return layout.export if layout.is_training_run() else Path(path)


def export_files(path: str | Path) -> list[Path]:
    """The files of the export that ``path`` names (``export_directory``); nothing is read."""
    directory = export_directory(path)
    return [directory / WEIGHTS_FILE, directory / CONFIG_FILE, directory / TOKENIZER_DIR]


def export_to_hf(export_dir: str | Path, out: str | Path) -> Path:
    """Write the transformers directory ``out`` of the unmask export ``export_dir`` (one
    written by ``export`` or by an import); returns ``out``."""
    export_dir, out = Path(export_dir), Path(out)
    check_output_dir(out, HF_EXPORT_KIND, "--out", [InputPath(export_dir, "the export it converts")])
    exported = load_export(export_dir)  # checks the config, the weights and the tokenizer
    write_hf_export(out, load_file(str(export_dir / WEIGHTS_FILE)), exported.config, export_dir / TOKENIZER_DIR)
    return out


def _track(run_dir: Path, out: Path) -> None:
    """Attach the export's config to the training's MLflow run, when it has one. The export
    is written already: a tracking server that is down costs a warning, not the export."""
    # Imported here, not at the top: MLflow takes a second to import, and load_export's
    # users (sampling, evaluation) never track through this module.
    from mlflow.exceptions import MlflowException

    from pipeline.tracking.tracker import Tracker, TrackingUnreachable

    try:
        tracker = Tracker.attach(run_dir, wait_s=TRACKING_WAIT_S)
        if tracker is not None:
            tracker.log_artifact(out / CONFIG_FILE, artifact_path=out.name)
    except (TrackingUnreachable, MlflowException, OSError) as err:
        log.warning("%s: exported, but its config was not attached to the MLflow run (%s)", out,
                    str(err).split("; ")[0])


def _check_complete(tensors: dict[str, torch.Tensor], spec: ModelSpec, checkpoint: Path) -> None:
    trained = build_trainable(spec, validate=False)
    expected = {canonical_name(name): tuple(p.shape) for name, p in trained.state_dict().items()}
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if expected != got:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        raise UserError(f"{checkpoint}: weights do not match the network in unmask_state.json "
                        f"(missing {missing[:5]}, unexpected {extra[:5]}, or shapes differ)")


def _unpadded(tensors: dict[str, torch.Tensor], spec: ModelSpec) -> tuple[dict[str, torch.Tensor], ModelSpec]:
    """The weights and spec without the padded vocabulary rows (``model.vocab_multiple``): an
    export holds the true vocabulary, so what reads it (load_export, transformers, other
    codebases) never meets a padded row."""
    unpadded = {name: tensor if tensor.shape == tensors[name].shape else tensor.clone()  # a slice: its own storage
                for name, tensor in unpadded_state(tensors, spec.network).items()}
    return unpadded, replace(spec, network=replace(spec.network, vocab_multiple=1))


def _export_config(spec: ModelSpec, state: CheckpointMeta, checkpoint: Path, weights: str) -> dict:
    """config.json: the spec's keys (``ModelSpec.to_dict``) and the export's provenance."""
    return {"format_version": EXPORT_FORMAT_VERSION, **spec.to_dict(), "weights": weights,
            "ema_decay": state.config["train"]["ema_decay"], "step": state.step,
            "tokens_seen": state.state.tokens_seen, "checkpoint": str(checkpoint.resolve()),
            "checkpoint_sha256": checkpoint_sha256(checkpoint),
            "tokenizer_sha256": state.tokenizer_sha256, "data_sha256": state.data_sha256,
            "config_sha256": state.config_sha256,
            **({"init_from": state.init_from} if state.init_from else {}), **_distilled(state)}


def _distilled(state: CheckpointMeta) -> dict:
    """A distilled student's record (``unmask distill``): the sampling steps it was distilled for."""
    distill = state.config.get("distill", {})
    return {"distilled": DistillSection(**distill).student_record(state.step)} if distill.get("enabled") else {}


def resolve_export(path: str | Path) -> Path:
    """The export directory of ``path``: an export itself, or a training run's ``RUN/export``."""
    path = Path(path)
    if (path / WEIGHTS_FILE).is_file() and (path / CONFIG_FILE).is_file():
        return path
    layout = RunLayout(path)
    if (layout.export / WEIGHTS_FILE).is_file():
        return layout.export
    if layout.is_training_run():
        raise UserError(f"{path}: a training run without an export; run `unmask export {path}` first")
    raise UserError(f"{path}: neither an export (no {WEIGHTS_FILE}) nor a training run "
                    f"(no {layout.checkpoints.name}/); give RUN or RUN/{layout.export.name}")


def training_run_of(export_dir: Path) -> Path | None:
    """The training run an export directory belongs to, or None for a standalone export."""
    return export_dir.parent if RunLayout(export_dir.parent).is_training_run() else None


@dataclass
class Exported:
    """A loaded export: the network (eval mode, float32, CPU), its config.json, the model's
    spec read from it, its tokenizer, and the trained parameters of its process (a learned
    schedule's ``theta``; empty for the other processes): ``process()`` builds the process."""

    network: Transformer
    config: dict
    tokenizer: Tokenizer
    spec: ModelSpec
    process_state: dict[str, torch.Tensor] = field(default_factory=dict)

    def process(self, *, validate: bool = True) -> Process:
        """The process the model was trained under, with its trained parameters, to score and
        sample with (a learned process draws ``EXPORT_DRAWS`` z_t per sequence)."""
        return build_process(self.spec, validate=validate, draws=EXPORT_DRAWS, state=self.process_state)


def _recorded_files(directory: Path) -> tuple[dict[str, FileRecord] | None, str | None]:
    """The records of the export's files in its marker, or why they cannot be trusted (naming
    the marker); (None, None) when it has no marker (copied without it)."""
    unreadable = marker_problem(directory)
    if unreadable is not None:
        return None, f"{unreadable}: the records of the export's files cannot be read"
    marker = read_marker(directory)
    if marker is None:
        return None, None
    if marker["kind"] != EXPORT_KIND.name:
        return None, (f"{directory / MARKER} marks the directory as an output of kind {marker['kind']!r}, not "
                      f"{EXPORT_KIND.name!r}: the records of the export's files cannot be trusted")
    files = marker.get("files")
    if not (isinstance(files, dict) and {WEIGHTS_FILE, CONFIG_FILE} <= files.keys()
            and all(isinstance(r, dict) and isinstance(r.get("bytes"), int) and isinstance(r.get("sha256"), str)
                    for r in files.values())):
        return None, f"{directory / MARKER} does not record the export's files (their sizes and sha256)"
    return files, None


def _first_change(directory: Path, changed: dict[str, str]) -> str | None:
    if not changed:
        return None
    name, how = next(iter(changed.items()))
    return f"{directory / name} {how}"


def verify_export(directory: Path) -> str | None:
    """What in the export ``directory`` differs from what was written, naming the file: a
    file its marker records that is missing, resized, or changed since its recorded
    modification time, or a marker that cannot be read or was changed; None when nothing does,
    or when it has no marker (copied without it: only reading it checks it). The quick check
    before a replacement or before reading its config.json; ``load_export`` hashes every file."""
    records, problem = _recorded_files(directory)
    if problem is not None or records is None:
        return problem
    return _first_change(directory, changed_files(directory, records, trust_times=True))


def _export_again(directory: Path) -> str:
    """How to get a sound export in the place of ``directory``."""
    run = training_run_of(directory)
    return (f"move {directory} away and export again: `unmask export {run}`" if run is not None else
            "export it again from its training run (`unmask export RUN --out DIR`), or copy it again")


def damaged_export(problem: str, directory: Path) -> UserError:
    """The one line for a damaged export: ``problem`` (naming the file) and how to get a sound one."""
    return UserError(f"{problem}; the export is damaged (an interrupted copy, or another file in its place): "
                     f"{_export_again(directory)}")


def _read_config(directory: Path) -> dict:
    """The export's config.json, of a format this version reads."""
    path = directory / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise damaged_export(f"{path}: not JSON ({err})", directory) from None
    if not isinstance(config, dict):
        raise damaged_export(f"{path}: not a JSON object", directory)
    version = config.get("format_version")
    if version is None or (isinstance(version, int) and not isinstance(version, bool)
                           and version < EXPORT_FORMAT_VERSION):
        raise UserError(f"{path}: format_version {version}, written by an earlier unmask (this one reads "
                        f"{EXPORT_FORMAT_VERSION}); {_export_again(directory)}")
    if not isinstance(version, int) or isinstance(version, bool):
        raise damaged_export(f"{path}: format_version {version!r} is not a number", directory)
    if version > EXPORT_FORMAT_VERSION:
        raise UserError(f"{path}: format_version {version} is newer than this unmask reads ({EXPORT_FORMAT_VERSION}); "
                        f"upgrade unmask, or export the model again with this version")
    return config


def _read_weights(directory: Path, map_location: str | torch.device) -> dict[str, torch.Tensor]:
    path = directory / WEIGHTS_FILE
    try:
        return load_file(str(path), device=str(map_location))
    except (SafetensorError, OSError) as err:
        raise damaged_export(f"{path}: not a readable safetensors file ({err})", directory) from None


def read_export_spec(directory: Path) -> tuple[dict, ModelSpec]:
    """The export's config.json, of a format this version reads, and the model's spec in it,
    checked as training and the imports check theirs (``ModelSpec``): a UserError naming
    config.json and the field (one edited by hand), or saying the format is newer."""
    path, config = directory / CONFIG_FILE, _read_config(directory)
    try:
        return config, ModelSpec.from_dict(config)
    except ValueError as err:
        raise UserError(f"{path}: {err}") from None
    except (KeyError, TypeError, AttributeError) as err:
        raise damaged_export(f"{path}: not the config of an unmask export ({type(err).__name__}: {err})",
                             directory) from None


def load_export(path: str | Path, *, map_location: str | torch.device = "cpu") -> Exported:
    """Load ``RUN/export`` (or any export directory) without DeepSpeed. Its config.json is read
    and checked first (a newer format, or a field the training and import checks refuse, is
    named as such, even when the file was edited since it was written); then every file its
    marker records is hashed and compared, the weights while the network is built. A damaged
    export is refused in one line naming the file."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise UserError(f"{path}: not an unmask export (no {CONFIG_FILE}); run `unmask export RUN`")
    config, spec = read_export_spec(path)
    records, problem = _recorded_files(path)
    records = records or {}
    weights = {name: record for name, record in records.items() if name == WEIGHTS_FILE}
    others = {name: record for name, record in records.items() if name != WEIGHTS_FILE}
    problem = problem or _first_change(path, resized_files(path, weights) or changed_files(path, others,
                                                                                          trust_times=False))
    if problem is not None:
        raise damaged_export(problem, path)
    with ThreadPoolExecutor(1) as pool:  # hashlib releases the GIL: on a free core the hash hides behind the build
        hashing = pool.submit(changed_files, path, weights, trust_times=False)
        network = build_network(spec)
        problem = _first_change(path, hashing.result())
    if problem is not None:
        raise damaged_export(problem, path)
    network_state, process_state = split_state(_read_weights(path, map_location))
    try:
        network.load_state_dict(network_state)
    except RuntimeError as err:  # names missing, unexpected or mis-shaped tensors
        raise damaged_export(f"{path / WEIGHTS_FILE}: its tensors are not those of the network in {CONFIG_FILE} "
                             f"({str(err).splitlines()[0]})", path) from None
    tokenizer = load_tokenizer(path / TOKENIZER_DIR)
    expected = config.get("tokenizer_sha256")
    if not isinstance(expected, str):
        raise damaged_export(f"{config_path}: no tokenizer_sha256 (the tokenizer the model was trained with)", path)
    if tokenizer.sha256 != expected:
        raise UserError(f"{path / TOKENIZER_DIR}: tokenizer sha256 differs from the one the model was "
                        f"trained with ({expected[:12]}...)")
    exported = Exported(network.eval(), config, tokenizer, spec, process_state)
    try:
        exported.process(validate=False)  # its process's parameters are all there, in their shapes
    except ValueError as err:
        raise UserError(f"{path / WEIGHTS_FILE}: {err}") from None
    return exported
