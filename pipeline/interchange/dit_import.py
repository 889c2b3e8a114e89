"""The DiT of MDLM and BD3-LM (SEDD's backbone), read from a release onto ``model.transformer.Transformer``.

MDLM (``pipeline.interchange.mdlm_import``) and BD3-LM (``pipeline.interchange.bd3lm_import``)
release one network, the DiT of SEDD's ``models/dit.py``, under the same tensor names
(prefixed ``backbone.``): ``vocab_embed.embedding`` (V + 1 rows, the mask's last),
``sigma_map.mlp.{0,2}``, per block ``norm1``, ``attn_qkv``, ``attn_out``, ``norm2``,
``mlp.{0,2}`` and ``adaLN_modulation`` (BD3-LM may leave those out), then
``output_layer.{norm_final,linear,adaLN_modulation}`` and ``rotary_emb.inv_freq`` (a buffer:
checked, not imported). This module maps the tensors, checks every name and shape, and writes
the export; ``dit_network`` gives the network the options that reproduce the DiT exactly. The
configuration and how each codebase runs the network live in their modules; the manual:
docs/import-export.md.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from common.errors import UserError
from data_prep.tokenizer.base import Tokenizer
from model.spec import ModelSpec, build_network
from model.transformer import LOGLINEAR_SIGMA_EPS, TransformerConfig
from pipeline.interchange.export import EXPORT_FORMAT_VERSION, write_export

__all__ = ["BACKBONE_PREFIX", "DIT_SCHEDULE", "HF_CONFIG_FILE", "HF_WEIGHTS_FILE", "ROTARY_BUFFER",
           "DitHyperParameters", "DitRelease", "backbone_tensors", "block_count", "check_declared", "config_int",
           "dit_network", "dit_parameter_names", "dit_state", "named_tensor", "read_hugging_face_files",
           "write_dit_export"]

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
BACKBONE_PREFIX = "backbone."
# A buffer of the DiT's rotary module that checkpoints carry: checked, not imported.
ROTARY_BUFFER = "rotary_emb.inv_freq"
# Constants of the DiT (models/dit.py of MDLM and BD3-LM), written in no config.
DIT_ROTARY_BASE = 10_000.0
DIT_NORM_EPS = 1e-5
# The noise both codebases train with: LogLinearNoise, whose eps their configs never change.
DIT_SCHEDULE = "loglinear"
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")
_ADALN_TENSORS = ("sigma_map.", "adaLN_modulation.")


@dataclass(frozen=True)
class DitHyperParameters:
    """What the network needs and its tensors do not say."""

    n_heads: int
    max_seq_len: int
    time_conditioning: bool
    adaln: bool = True       # adaLN modulation (BD3-LM's ``adaln``; MDLM's DiT always has it)


@dataclass(frozen=True)
class DitRelease:
    """A DiT read from a release: its tensors (names without ``backbone.``), what they do not say,
    the export's provenance keys (``weights``, ``step``, ``imported_from``, ...) and, for BD3-LM,
    its block size."""

    tensors: Mapping[str, torch.Tensor]
    hyper: DitHyperParameters
    provenance: dict[str, Any]
    block_size: int | None = None  # block diffusion's L'; None: MDLM (one block)


def dit_parameter_names(n_blocks: int, adaln: bool = True) -> list[tuple[str, str]]:
    """(the DiT's name without ``backbone.``, ours) of every parameter, in the order of the DiT's
    ``backbone.parameters()`` (MDLM's EMA ``shadow_params`` follow it); without ``adaln`` the
    time embedding and the modulations are left out."""
    names = [("vocab_embed.embedding", "embed.weight")]
    names += [(f"sigma_map.mlp.{i}.{p}", f"time_embed.mlp.{i}.{p}") for i in (0, 2) for p in ("weight", "bias")]
    block = [("norm1.weight", "attn_norm.weight"), ("attn_qkv.weight", "attn.qkv.weight"),
             ("attn_out.weight", "attn.out.weight"), ("norm2.weight", "mlp_norm.weight"),
             ("mlp.0.weight", "mlp.up.weight"), ("mlp.0.bias", "mlp.up.bias"),
             ("mlp.2.weight", "mlp.down.weight"), ("mlp.2.bias", "mlp.down.bias"),
             ("adaLN_modulation.weight", "modulation.weight"), ("adaLN_modulation.bias", "modulation.bias")]
    names += [(f"blocks.{n}.{theirs}", f"blocks.{n}.{ours}") for n in range(n_blocks) for theirs, ours in block]
    names += [("output_layer.norm_final.weight", "final_norm.weight"), ("output_layer.linear.weight", "head.weight"),
              ("output_layer.linear.bias", "head.bias"),
              ("output_layer.adaLN_modulation.weight", "final_modulation.weight"),
              ("output_layer.adaLN_modulation.bias", "final_modulation.bias")]
    if not adaln:
        names = [(theirs, ours) for theirs, ours in names if not any(part in theirs for part in _ADALN_TENSORS)]
    return names


def dit_network(tensors: Mapping[str, torch.Tensor], hyper: DitHyperParameters, vocab_size: int,
                codebase: str) -> TransformerConfig:
    """Our network for ``codebase``'s DiT whose tensors (names without ``backbone.``) are
    ``tensors``, over a tokenizer of ``vocab_size`` tokens (the mask is one more)."""
    embedding = named_tensor(tensors, "vocab_embed.embedding", dims=2)
    if embedding.shape[0] != vocab_size + 1:
        raise UserError(f"{BACKBONE_PREFIX}vocab_embed.embedding has {embedding.shape[0]} rows, a vocabulary of "
                        f"{embedding.shape[0] - 1} tokens plus the mask, but the tokenizer has {vocab_size} tokens; "
                        f"give the tokenizer the model was trained with (GPT-2's BPE for {codebase}'s OpenWebText "
                        "models)")
    width = embedding.shape[1]
    hidden = named_tensor(tensors, "blocks.0.mlp.0.weight", dims=2).shape[0]
    if hidden % width:
        raise UserError(f"{BACKBONE_PREFIX}blocks.0.mlp.0.weight has {hidden} rows, not a multiple of the "
                        f"width {width}")
    time: dict[str, Any] = {}
    if hyper.adaln:
        time_in = named_tensor(tensors, "sigma_map.mlp.0.weight", dims=2)
        time = {"time_embed_dim": time_in.shape[0], "time_frequencies": time_in.shape[1],
                "time_conditioning": hyper.time_conditioning, "adaptive_norm": True,
                "time_input": "loglinear_sigma"}
    try:
        return TransformerConfig(
            vocab_size=vocab_size, n_layers=block_count(tensors), d_model=width, n_heads=hyper.n_heads,
            max_seq_len=hyper.max_seq_len, mlp_ratio=hidden // width, dropout=0.0, tie_weights=False,
            rope_base=DIT_ROTARY_BASE, norm_eps=DIT_NORM_EPS, mlp_bias=True, head_bias=True, head_mask_row=True,
            rope_angles="float32", **time)
    except ValueError as err:
        raise UserError(f"{codebase}'s DiT does not fit an unmask network: {err}") from None


# ------------------------------------------------------------------ Hugging Face directory
def read_hugging_face_files(directory: Path, model_type: str, codebase: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``config.json`` (checked to be of ``model_type``) and every tensor of ``model.safetensors``."""
    config = _json_file(directory / HF_CONFIG_FILE)
    if config.get("model_type") != model_type:
        raise UserError(f"{directory / HF_CONFIG_FILE}: model_type is {config.get('model_type')!r}, not "
                        f"{model_type!r}: not a {codebase} model")
    weights_file = directory / HF_WEIGHTS_FILE
    if not weights_file.is_file():
        raise UserError(f"{directory}: no {HF_WEIGHTS_FILE}; download the model's files into it")
    try:
        return config, load_file(str(weights_file))
    except (SafetensorError, OSError) as err:
        raise UserError(f"{weights_file}: not a readable safetensors file ({err})") from None


def check_declared(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], path: Path,
                   adaln: bool = True) -> None:
    """The sizes config.json declares agree with the tensors' (``cond_dim`` only with adaLN: it
    sizes nothing without it)."""
    declared = {"vocab_size": ("vocab_embed.embedding", 0), "hidden_dim": ("vocab_embed.embedding", 1)}
    if adaln:
        declared["cond_dim"] = ("sigma_map.mlp.0.weight", 0)
    for field, (name, dim) in declared.items():
        actual = named_tensor(tensors, name, dims=2).shape[dim]
        if field in config and config[field] != actual:
            raise UserError(f"{path}: {field} is {config[field]}, but {BACKBONE_PREFIX}{name} has size {actual} "
                            f"in dimension {dim}")
    if "n_blocks" in config and config["n_blocks"] != block_count(tensors):
        raise UserError(f"{path}: n_blocks is {config['n_blocks']}, but the weights hold "
                        f"{block_count(tensors)} blocks")


def config_int(config: Mapping[str, Any], field: str, where: Path | str) -> int:
    """The positive integer ``config[field]``, or a ``UserError`` naming it."""
    value = config.get(field)
    if type(value) is not int or value < 1:
        raise UserError(f"{where}: {field} is {value!r}, expected a positive integer")
    return value


def _json_file(path: Path) -> dict:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path.parent}: no {path.name}; not a Hugging Face model directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(record, dict):
        raise UserError(f"{path}: not a JSON object")
    return record


# ------------------------------------------------------------------ checks and renaming
def backbone_tensors(record: Mapping[str, Any], path: Path, codebase: str) -> dict[str, Any]:
    """The entries of ``record`` without their ``backbone.`` prefix; any other entry is refused."""
    others = [key for key in record if not (isinstance(key, str) and key.startswith(BACKBONE_PREFIX))]
    if others:
        raise UserError(f"{path}: unknown tensor {others[0]!r}: {codebase}'s weights all lie under "
                        f"{BACKBONE_PREFIX!r}")
    return {key[len(BACKBONE_PREFIX):]: value for key, value in record.items()}


def dit_state(tensors: Mapping[str, torch.Tensor], spec: ModelSpec, codebase: str) -> dict[str, torch.Tensor]:
    """Our network's state dict from the DiT's tensors; every tensor accounted for, every shape checked."""
    _check_rotary(tensors, spec.network)
    names = dit_parameter_names(spec.network.n_layers, adaln=spec.network.modulated)
    known = {theirs for theirs, _ in names} | {ROTARY_BUFFER}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise UserError(f"unknown tensor {BACKBONE_PREFIX}{unknown[0]}: not part of {codebase}'s DiT"
                        f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}")
    expected = {name: tuple(value.shape) for name, value in build_network(spec).state_dict().items()}
    ours = {}
    for theirs, our_name in names:
        if theirs not in tensors:
            raise UserError(f"missing tensor {BACKBONE_PREFIX}{theirs}")
        tensor = tensors[theirs]
        if tuple(tensor.shape) != expected[our_name]:
            raise UserError(f"{BACKBONE_PREFIX}{theirs} has shape {tuple(tensor.shape)}, expected "
                            f"{expected[our_name]} for a DiT of width {spec.network.d_model}")
        if not tensor.is_floating_point():
            raise UserError(f"{BACKBONE_PREFIX}{theirs} holds {tensor.dtype}, not floating-point weights")
        ours[our_name] = tensor.float().contiguous()
    return ours


def _check_rotary(tensors: Mapping[str, torch.Tensor], network: TransformerConfig) -> None:
    """The rotary frequencies a checkpoint carries are the DiT's (base 10000), which the network rebuilds."""
    if ROTARY_BUFFER not in tensors:
        return
    head_dim = network.head_dim
    expected = 1.0 / (DIT_ROTARY_BASE ** (torch.arange(0, head_dim, 2).float() / head_dim))
    found = tensors[ROTARY_BUFFER]
    if found.shape != expected.shape or not torch.allclose(found.float(), expected, rtol=1e-6, atol=0):
        raise UserError(f"{BACKBONE_PREFIX}{ROTARY_BUFFER} is not the rotary frequencies of base "
                        f"{DIT_ROTARY_BASE:g} for heads of {head_dim} (shape {tuple(found.shape)}): a different "
                        "rotary embedding, or n_heads is not the model's")


def block_count(tensors: Mapping[str, Any]) -> int:
    """How many blocks the weights hold (numbered 0..N-1, or refused)."""
    indices = {int(match.group(1)) for name in tensors if (match := _BLOCK_KEY.match(name))}
    if not indices or indices != set(range(max(indices) + 1)):
        raise UserError(f"the weights' blocks are not numbered 0..N-1: {sorted(indices)[:10]}")
    return max(indices) + 1


def named_tensor(tensors: Mapping[str, Any], name: str, *, dims: int) -> Any:
    """``tensors[name]``, checked to exist and have ``dims`` dimensions."""
    if name not in tensors:
        raise UserError(f"missing tensor {BACKBONE_PREFIX}{name}")
    shape = tuple(tensors[name].shape)
    if len(shape) != dims:
        raise UserError(f"{BACKBONE_PREFIX}{name} has shape {shape}, expected {dims} dimensions")
    return tensors[name]


def write_dit_export(out: Path, release: DitRelease, tokenizer: Tokenizer, codebase: str) -> None:
    """The unmask export of ``release`` over ``tokenizer``: our network with the DiT's weights, under
    the log-linear schedule both codebases train with (eps ``LOGLINEAR_SIGMA_EPS``, at which our t is
    theirs), block diffusion at the release's block size if it has one."""
    spec = ModelSpec(network=dit_network(release.tensors, release.hyper, tokenizer.vocab_size, codebase),
                     objective="diffusion", process="absorbing", schedule=DIT_SCHEDULE,
                     schedule_args={"eps": LOGLINEAR_SIGMA_EPS}, block_size=release.block_size)
    tensors = dit_state(release.tensors, spec, codebase)
    config = {"format_version": EXPORT_FORMAT_VERSION, **spec.to_dict(), "tokenizer_sha256": tokenizer.sha256,
              "tokens_seen": None, **release.provenance}
    # The tokenizer's own files only (not whatever else its directory holds).
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = Path(scratch) / "tokenizer"
        tokenizer.save(tokenizer_dir)
        write_export(out, tensors, config, tokenizer_dir)
