"""Import BD3-LM's released checkpoints (Arriola et al. 2025) as unmask exports: ``import_bd3lm``.

SOURCE is a Hugging Face directory: ``config.json`` (``model_type: bd3lm``) and
``model.safetensors``, the DiT backbone's tensors prefixed ``backbone.``
(``pipeline.interchange.dit_import``). BD3-LM's forward over [x_t ; x_0] under its
``block_diff_mask`` is our block model's (``model.block_attention``), so the export is block
diffusion at the release's ``block_size``, with BD3-LM's schedule; ``sampling_eps_min`` and
``sampling_eps_max`` are recorded, not used. What our block model cannot compute exactly
(``cross_attn: false``, ``causal: true``, another ``attn_backend``, time conditioning with adaLN,
a block size that does not divide ``model_length``), and anything that does not fit (the
vocabulary, a shape, a missing or unknown tensor), is refused with a ``UserError`` naming the
field or tensor. The mapping, field by field: docs/import-export.md, "Importing BD3-LM's
checkpoints".
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from common.errors import UserError
from common.outputs import InputPath, check_output_dir
from data_prep.tokenizer.load import load_tokenizer
from pipeline.interchange.dit_import import (
    HF_CONFIG_FILE,
    HF_WEIGHTS_FILE,
    DitHyperParameters,
    DitRelease,
    backbone_tensors,
    check_declared,
    config_int,
    read_hugging_face_files,
    write_dit_export,
)
from pipeline.interchange.export import EXPORT_KIND, check_outside_runs

__all__ = ["import_bd3lm"]

CODEBASE = "BD3-LM"
BD3LM_MODEL_TYPE = "bd3lm"
# BD3-LM's training clip of each block's masking rate ([beta, omega], its ``var_min``): buffers of
# its model beside the backbone, not part of the network.
MASK_RATE_BUFFERS = ("sampling_eps_min", "sampling_eps_max")
# Attention backends of modeling_bd3lm.py; both compute block_diff_mask.
ATTENTION_BACKENDS = ("flex", "sdpa")
# BD3LMConfig's defaults, which a config.json without the field takes.
DEFAULTS = {"cross_attn": True, "adaln": True, "causal": False, "time_conditioning": False, "attn_backend": "flex"}


def import_bd3lm(source: str | Path, tokenizer_dir: str | Path, out: str | Path) -> Path:
    """Write the unmask export ``out`` of BD3-LM's Hugging Face directory ``source`` with the
    tokenizer at ``tokenizer_dir``; returns ``out``. The export is block diffusion at the
    model's block size under the log-linear schedule BD3-LM trains with. ``out`` is checked
    first (``common.outputs``): an earlier export, or a new or empty directory, never the
    source or the tokenizer."""
    source, out = Path(source), Path(out)
    check_output_dir(out, EXPORT_KIND, "--out", [InputPath(source, "SOURCE"), InputPath(tokenizer_dir, "--tokenizer")])
    check_outside_runs(out, "--out")  # RUN/export is the run's own model
    tokenizer = load_tokenizer(tokenizer_dir)
    if not source.is_dir():
        raise UserError(f"{source}: {'is a file' if source.exists() else 'does not exist'}; give BD3-LM's Hugging "
                        f"Face directory ({HF_CONFIG_FILE} and {HF_WEIGHTS_FILE}), e.g. bd3lm-owt-block_size4/")
    write_dit_export(out, _read(source), tokenizer, CODEBASE)
    return out


def _read(directory: Path) -> DitRelease:
    config, raw = read_hugging_face_files(directory, BD3LM_MODEL_TYPE, CODEBASE)
    where = directory / HF_CONFIG_FILE
    block_size, hyper = _network_options(config, where)
    mask_rate = _mask_rate_interval(raw, directory / HF_WEIGHTS_FILE)
    tensors = backbone_tensors(raw, directory / HF_WEIGHTS_FILE, CODEBASE)
    check_declared(config, tensors, where, adaln=hyper.adaln)
    provenance = {"weights": "published", "step": None,
                  "weights_note": "the weights of BD3-LM's Hugging Face directory, as published",
                  "imported_from": {"codebase": "bd3lm", "layout": "huggingface", "source": str(directory.resolve()),
                                    "block_size": block_size, "training_mask_rate": mask_rate}}
    return DitRelease(tensors, hyper, provenance, block_size=block_size)


def _network_options(config: Mapping[str, Any], where: Path) -> tuple[int, DitHyperParameters]:
    """The block size and what the network needs from config.json; what our block model cannot
    compute exactly is refused, naming the field."""
    block_size = config_int(config, "block_size", where)
    length = config_int(config, "model_length", where)
    if length % block_size:
        raise UserError(f"{where}: block_size {block_size} does not divide model_length {length}: unmask's block "
                        "model takes whole blocks")
    flags = {field: _flag(config, field, where) for field in ("cross_attn", "adaln", "causal", "time_conditioning")}
    if not flags["cross_attn"]:
        raise UserError(f"{where}: cross_attn is false: BD3-LM's network then attends over x_t alone, every noisy "
                        "block seeing the others, which is no block-diffusion model; unmask imports cross_attn: "
                        "true models (the released ones)")
    if flags["causal"]:
        raise UserError(f"{where}: causal is true: a causal mask over the block mask is not BD3-LM's block "
                        "diffusion; unmask imports causal: false models (the released ones)")
    if flags["adaln"] and flags["time_conditioning"]:
        raise UserError(f"{where}: time_conditioning is true: BD3-LM then feeds adaLN one sigma per sequence, "
                        "and unmask's block diffusion runs a time-free network (one time per block); unmask "
                        "imports time_conditioning: false models (the released ones)")
    backend = config.get("attn_backend", DEFAULTS["attn_backend"])
    if backend not in ATTENTION_BACKENDS:
        raise UserError(f"{where}: attn_backend is {backend!r}, not one of {', '.join(ATTENTION_BACKENDS)} "
                        "(BD3-LM's backends of its block mask)")
    return block_size, DitHyperParameters(n_heads=config_int(config, "n_heads", where), max_seq_len=length,
                                          time_conditioning=False, adaln=flags["adaln"])


def _flag(config: Mapping[str, Any], field: str, where: Path) -> bool:
    value = config.get(field, DEFAULTS[field])
    if type(value) is not bool:
        raise UserError(f"{where}: {field} is {value!r}, expected true or false")
    return value


def _mask_rate_interval(raw: dict[str, torch.Tensor], path: Path) -> list[float | None] | None:
    """Removes BD3-LM's mask-rate buffers from ``raw``; their [min, max], or None without them."""
    found = {name: raw.pop(name) for name in MASK_RATE_BUFFERS if name in raw}
    for name, value in found.items():
        if value.numel() != 1 or not value.is_floating_point():
            raise UserError(f"{path}: {name} has shape {tuple(value.shape)} and dtype {value.dtype}, expected one "
                            "floating-point number (BD3-LM's training clip of the masking rate)")
    if not found:
        return None
    # Stored in float32: its 7 significant digits (0.001, not 0.0010000000474974513).
    return [float(f"{float(found[name]):.7g}") if name in found else None for name in MASK_RATE_BUFFERS]
