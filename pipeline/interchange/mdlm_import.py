"""Import MDLM's released checkpoints (Sahoo et al. 2024) as unmask exports: ``import_mdlm``.

SOURCE is either of MDLM's layouts: a Hugging Face directory (``config.json`` with
``model_type: mdlm``, ``model.safetensors`` with the DiT backbone's tensors prefixed
``backbone.``), or a PyTorch Lightning ``.ckpt`` of its training code (``state_dict``, the EMA's
``ema.shadow_params`` in the backbone's parameter order, ``hyper_parameters.config``), read by
``pipeline.interchange.inert_pickle`` without running any of the objects it pickles. The DiT
maps onto ``model.transformer.Transformer`` exactly (``pipeline.interchange.dit_import``), and
the export takes MDLM's schedule (``loglinear``, eps 1e-3), under which our t is MDLM's t.
Anything that does not fit (the vocabulary, a shape, a missing or unknown tensor) is refused
with a ``UserError`` naming the tensor or field. The manual: docs/import-export.md, "Importing
MDLM's checkpoints".
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from common.errors import UserError
from common.outputs import InputPath, check_output_dir
from data_prep.tokenizer.load import load_tokenizer
from pipeline.interchange.dit_import import (
    BACKBONE_PREFIX,
    DIT_SCHEDULE,
    HF_CONFIG_FILE,
    HF_WEIGHTS_FILE,
    DitHyperParameters,
    DitRelease,
    backbone_tensors,
    block_count,
    check_declared,
    config_int,
    dit_parameter_names,
    read_hugging_face_files,
    write_dit_export,
)
from pipeline.interchange.export import EXPORT_KIND, check_outside_runs
from pipeline.interchange.inert_pickle import InertArchive, InertObject, TensorRef

__all__ = ["import_mdlm"]

CODEBASE = "MDLM"
MDLM_MODEL_TYPE = "mdlm"
# MDLM's training parameterization: SUBS.
MDLM_PARAMETERIZATION = "subs"
# Nested OmegaConf or dict-like records deeper than this are not configuration.
_MAX_CONFIG_DEPTH = 32

WeightsChoice = Literal["ema", "model"]


def import_mdlm(source: str | Path, tokenizer_dir: str | Path, out: str | Path, *,
                weights: WeightsChoice | None = None) -> Path:
    """Write the unmask export ``out`` of MDLM's model at ``source`` (a Hugging Face directory
    or a Lightning ``.ckpt``) with the tokenizer at ``tokenizer_dir``; returns ``out``.

    ``weights`` chooses in a ``.ckpt``: ``"ema"`` (the default) or ``"model"`` (the live
    weights); a Hugging Face directory holds one set and takes neither. ``out`` is checked
    first (``common.outputs``): an earlier export, or a new or empty directory, never the
    source or the tokenizer.
    """
    source, out = Path(source), Path(out)
    check_output_dir(out, EXPORT_KIND, "--out", [InputPath(source, "SOURCE"), InputPath(tokenizer_dir, "--tokenizer")])
    check_outside_runs(out, "--out")  # RUN/export is the run's own model
    tokenizer = load_tokenizer(tokenizer_dir)
    if source.is_dir():
        if weights is not None:
            raise UserError(f"{source}: a Hugging Face directory holds one set of weights; --weights chooses "
                            "between the EMA and the live weights of a .ckpt")
        tensors, hyper, provenance = _read_hugging_face(source)
    elif source.is_file():
        tensors, hyper, provenance = _read_lightning(source, weights or "ema")
    else:
        raise UserError(f"{source}: does not exist; give MDLM's Hugging Face directory or a .ckpt file")
    write_dit_export(out, DitRelease(tensors, hyper, provenance), tokenizer, CODEBASE)
    return out


# ------------------------------------------------------------------ Hugging Face directory
def _read_hugging_face(directory: Path) -> tuple[dict[str, torch.Tensor], DitHyperParameters, dict]:
    config, raw = read_hugging_face_files(directory, MDLM_MODEL_TYPE, CODEBASE)
    where = directory / HF_CONFIG_FILE
    tensors = backbone_tensors(raw, directory / HF_WEIGHTS_FILE, CODEBASE)
    hyper = DitHyperParameters(n_heads=config_int(config, "n_heads", where),
                               max_seq_len=config_int(config, "model_length", where),
                               time_conditioning=bool(config.get("time_conditioning", False)))
    check_declared(config, tensors, where)
    return tensors, hyper, {"weights": "published", "step": None,
                            "weights_note": "the weights of MDLM's Hugging Face directory, as published",
                            "imported_from": {"codebase": "mdlm", "layout": "huggingface",
                                              "source": str(directory.resolve())}}


# ------------------------------------------------------------------ Lightning checkpoint
def _read_lightning(path: Path, weights: WeightsChoice) -> tuple[dict[str, torch.Tensor], DitHyperParameters, dict]:
    if weights not in ("ema", "model"):
        raise UserError(f"--weights must be 'ema' or 'model', got {weights!r}")
    with InertArchive(path) as archive:
        root = archive.root()
        if not isinstance(root, dict) or not isinstance(root.get("state_dict"), Mapping):
            raise UserError(f"{path}: no state_dict: not a Lightning checkpoint")
        refs = backbone_tensors(root["state_dict"], path, CODEBASE)
        hyper = _hyper_parameters(root.get("hyper_parameters"), path)
        ema = root.get("ema")
        if weights == "ema":
            refs = _ema_refs(ema, refs, path)
        tensors = {name: _read_tensor(archive, ref, name, path) for name, ref in refs.items()}
    step = root.get("global_step")
    provenance = {"weights": weights, "step": step if type(step) is int else None,
                  "imported_from": {"codebase": "mdlm", "layout": "lightning", "source": str(path.resolve())}}
    if weights == "ema" and isinstance(ema.get("decay"), float):
        provenance["ema_decay"] = ema["decay"]
    return tensors, hyper, provenance


def _ema_refs(ema: Any, live: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The EMA's tensors named as the live ones: ``shadow_params`` follow the backbone's
    parameter order (``pipeline.interchange.dit_import.dit_parameter_names``); buffers (the
    rotary frequencies) have no EMA."""
    if not isinstance(ema, dict) or not isinstance(ema.get("shadow_params"), list):
        raise UserError(f"{path}: holds no EMA (no ema.shadow_params); import its live weights with --weights model")
    names = [theirs for theirs, _ in dit_parameter_names(block_count(live))]
    shadows = ema["shadow_params"]
    if len(shadows) != len(names):
        raise UserError(f"{path}: ema.shadow_params holds {len(shadows)} tensors, but MDLM's DiT with "
                        f"{block_count(live)} blocks has {len(names)} parameters")
    refs = {name: live[name] for name in live if name not in names}  # buffers, checked later
    for index, (name, shadow) in enumerate(zip(names, shadows)):
        if name not in live:
            raise UserError(f"{path}: missing tensor {BACKBONE_PREFIX}{name} in state_dict")
        live_shape = getattr(live[name], "shape", None)
        if not isinstance(shadow, TensorRef) or shadow.shape != live_shape:
            raise UserError(f"{path}: ema.shadow_params[{index}] ({BACKBONE_PREFIX}{name}) has shape "
                            f"{getattr(shadow, 'shape', shadow)}, the live tensor {live_shape}")
        refs[name] = shadow
    return refs


def _read_tensor(archive: InertArchive, ref: Any, name: str, path: Path) -> torch.Tensor:
    if not isinstance(ref, TensorRef):
        raise UserError(f"{path}: {BACKBONE_PREFIX}{name} is not a tensor ({ref!r})")
    return archive.tensor(ref)


def _hyper_parameters(record: Any, path: Path) -> DitHyperParameters:
    """``hyper_parameters.config`` of MDLM's training, checked: a SUBS model, and the
    log-linear noise whenever the network sees the time."""
    record = _plain(record)
    config = record.get("config") if isinstance(record, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise UserError(f"{path}: its hyper_parameters hold no MDLM config (config.model); not a checkpoint of "
                        "MDLM's training code")
    model = config["model"]
    where = f"{path}: hyper_parameters.config"
    if config.get("parameterization", MDLM_PARAMETERIZATION) != MDLM_PARAMETERIZATION:
        raise UserError(f"{where}.parameterization is {config['parameterization']!r}: unmask imports SUBS models only")
    if config.get("backbone", "dit") != "dit":
        raise UserError(f"{where}.backbone is {config['backbone']!r}: unmask imports the DiT backbone only")
    time_conditioning = bool(config.get("time_conditioning", False))
    noise = config.get("noise")
    noise_type = noise.get("type", DIT_SCHEDULE) if isinstance(noise, dict) else DIT_SCHEDULE
    if time_conditioning and noise_type != DIT_SCHEDULE:
        raise UserError(f"{where}.noise.type is {noise_type!r}: a time-conditioned model is imported under the "
                        f"log-linear noise only (it sees sigma(t) of that schedule)")
    for field in ("n_heads", "length"):
        if type(model.get(field)) is not int or model[field] < 1:
            raise UserError(f"{where}.model.{field} is {model.get(field)!r}, expected a positive integer")
    return DitHyperParameters(n_heads=model["n_heads"], max_seq_len=model["length"],
                               time_conditioning=time_conditioning)


def _plain(value: Any, depth: int = 0) -> Any:
    """Plain dicts, lists and values from inert records: an OmegaConf container keeps its
    items in ``_content`` and a value node its value in ``_val``; a dict subclass (Lightning's
    ``AttributeDict``) keeps its items as entries. Parents and metadata are not followed."""
    if depth > _MAX_CONFIG_DEPTH:
        return None
    if isinstance(value, InertObject):
        state = value.state if isinstance(value.state, dict) else {}
        if "_content" in state:
            return _plain(state["_content"], depth + 1)
        if "_val" in state:
            return _plain(state["_val"], depth + 1)
        return _plain(value.entries, depth + 1) if value.entries else value
    if isinstance(value, dict):
        return {key: _plain(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item, depth + 1) for item in value]
    return value
