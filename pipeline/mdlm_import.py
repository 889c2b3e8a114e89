"""Import MDLM's released checkpoints (Sahoo et al. 2024) as unmask exports.

MDLM publishes its models in two layouts, both read here:

- a Hugging Face directory: ``config.json`` (``model_type: mdlm``: ``hidden_dim``, ``cond_dim``,
  ``n_blocks``, ``n_heads``, ``vocab_size``, ``model_length``, ``time_conditioning``) and
  ``model.safetensors``, whose keys are the DiT backbone's, prefixed ``backbone.``;
- a PyTorch Lightning ``.ckpt`` of its training code: ``state_dict`` (the same keys, the live
  weights), ``ema.shadow_params`` (the EMA, a list in the order of the backbone's parameters)
  and ``hyper_parameters.config`` (an OmegaConf tree: ``model.n_heads``, ``model.length``,
  ``time_conditioning``, ``parameterization``, ``noise.type``). The file also pickles objects
  of other libraries; ``pipeline.inert_pickle`` reads it without running any of them.

The DiT maps onto ``model.transformer.Transformer`` with the options that reproduce it
exactly (``mdlm_network``): biases on the MLP and the head, an untied head with V + 1 rows
(the mask's logit is dropped, which is SUBS), adaLN always on, fed by the 256-frequency
embedding of the log-linear total noise sigma(t) (sigma = 0 when MDLM's time conditioning is
off), MDLM's rounding of the rotary angles. The export's spec takes MDLM's schedule
(``loglinear``, eps 1e-3), under which our t is MDLM's t. Anything that does not fit, a
vocabulary other than the tokenizer's, a shape, a missing or unknown tensor, is refused
with a ``UserError`` naming the tensor or field.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from common.errors import UserError
from common.outputs import InputPath, check_output_dir
from data_prep.tokenizer import Tokenizer, load_tokenizer
from model.spec import ModelSpec, build_network
from model.transformer import LOGLINEAR_SIGMA_EPS, TransformerConfig
from pipeline.export import EXPORT_FORMAT_VERSION, EXPORT_KIND, write_export
from pipeline.inert_pickle import InertArchive, InertObject, TensorRef

__all__ = ["MdlmHyperParameters", "import_mdlm", "mdlm_network", "mdlm_parameter_names"]

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
MDLM_MODEL_TYPE = "mdlm"
BACKBONE_PREFIX = "backbone."
# A buffer of MDLM's rotary module that checkpoints carry: checked, not imported.
ROTARY_BUFFER = "rotary_emb.inv_freq"
# Constants of MDLM's DiT (models/dit.py), written in no config.
MDLM_ROTARY_BASE = 10_000.0
MDLM_NORM_EPS = 1e-5
# MDLM's training: the log-linear noise (LogLinearNoise's eps) and the SUBS parameterization.
MDLM_SCHEDULE = "loglinear"
MDLM_PARAMETERIZATION = "subs"
# Nested OmegaConf or dict-like records deeper than this are not configuration.
_MAX_CONFIG_DEPTH = 32
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")

WeightsChoice = Literal["ema", "model"]


@dataclass(frozen=True)
class MdlmHyperParameters:
    """What the network needs and its tensors do not say."""

    n_heads: int
    max_seq_len: int
    time_conditioning: bool


def mdlm_parameter_names(n_blocks: int) -> list[tuple[str, str]]:
    """(MDLM's name without ``backbone.``, ours) of every parameter, in the order of MDLM's
    ``backbone.parameters()``, which is the order of its EMA's ``shadow_params``."""
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
    return names


def mdlm_network(tensors: Mapping[str, torch.Tensor], hyper: MdlmHyperParameters, vocab_size: int) -> TransformerConfig:
    """Our network for MDLM's DiT whose tensors (names without ``backbone.``) are ``tensors``,
    over a tokenizer of ``vocab_size`` tokens (the mask is one more)."""
    embedding = _named(tensors, "vocab_embed.embedding", dims=2)
    if embedding.shape[0] != vocab_size + 1:
        raise UserError(f"{BACKBONE_PREFIX}vocab_embed.embedding has {embedding.shape[0]} rows, a vocabulary of "
                        f"{embedding.shape[0] - 1} tokens plus the mask, but the tokenizer has {vocab_size} tokens; "
                        "give the tokenizer the model was trained with (GPT-2's BPE for MDLM's OpenWebText model)")
    width = embedding.shape[1]
    time_in = _named(tensors, "sigma_map.mlp.0.weight", dims=2)
    hidden = _named(tensors, "blocks.0.mlp.0.weight", dims=2).shape[0]
    if hidden % width:
        raise UserError(f"{BACKBONE_PREFIX}blocks.0.mlp.0.weight has {hidden} rows, not a multiple of the "
                        f"width {width}")
    try:
        return TransformerConfig(
            vocab_size=vocab_size, n_layers=_block_count(tensors), d_model=width, n_heads=hyper.n_heads,
            max_seq_len=hyper.max_seq_len, mlp_ratio=hidden // width, dropout=0.0,
            time_conditioning=hyper.time_conditioning, time_embed_dim=time_in.shape[0], tie_weights=False,
            rope_base=MDLM_ROTARY_BASE, norm_eps=MDLM_NORM_EPS, mlp_bias=True, head_bias=True, head_mask_row=True,
            adaptive_norm=True, time_frequencies=time_in.shape[1], time_input="loglinear_sigma", rope_angles="float32")
    except ValueError as err:
        raise UserError(f"MDLM's DiT does not fit an unmask network: {err}") from None


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
    spec = ModelSpec(network=mdlm_network(tensors, hyper, tokenizer.vocab_size), objective="diffusion",
                     process="absorbing", schedule=MDLM_SCHEDULE, schedule_args={"eps": LOGLINEAR_SIGMA_EPS})
    ours = _renamed(tensors, spec)
    config = {"format_version": EXPORT_FORMAT_VERSION, **spec.to_dict(), "tokenizer_sha256": tokenizer.sha256,
              "tokens_seen": None, **provenance}
    _write(out, ours, config, tokenizer)
    return out


# ------------------------------------------------------------------ Hugging Face directory
def _read_hugging_face(directory: Path) -> tuple[dict[str, torch.Tensor], MdlmHyperParameters, dict]:
    config = _json_file(directory / HF_CONFIG_FILE)
    if config.get("model_type") != MDLM_MODEL_TYPE:
        raise UserError(f"{directory / HF_CONFIG_FILE}: model_type is {config.get('model_type')!r}, not "
                        f"{MDLM_MODEL_TYPE!r}: not an MDLM model")
    weights_file = directory / HF_WEIGHTS_FILE
    if not weights_file.is_file():
        raise UserError(f"{directory}: no {HF_WEIGHTS_FILE}; download the model's files into it")
    try:
        raw = load_file(str(weights_file))
    except (SafetensorError, OSError) as err:
        raise UserError(f"{weights_file}: not a readable safetensors file ({err})") from None
    tensors = _backbone(raw, weights_file)
    hyper = MdlmHyperParameters(n_heads=_config_int(config, "n_heads", directory / HF_CONFIG_FILE),
                                max_seq_len=_config_int(config, "model_length", directory / HF_CONFIG_FILE),
                                time_conditioning=bool(config.get("time_conditioning", False)))
    _check_declared(config, tensors, directory / HF_CONFIG_FILE)
    return tensors, hyper, {"weights": "published", "step": None,
                            "weights_note": "the weights of MDLM's Hugging Face directory, as published",
                            "imported_from": {"codebase": "mdlm", "layout": "huggingface",
                                              "source": str(directory.resolve())}}


def _check_declared(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """The sizes config.json declares agree with the tensors'."""
    declared = {"vocab_size": ("vocab_embed.embedding", 0), "hidden_dim": ("vocab_embed.embedding", 1),
                "cond_dim": ("sigma_map.mlp.0.weight", 0)}
    for field, (name, dim) in declared.items():
        actual = _named(tensors, name, dims=2).shape[dim]
        if field in config and config[field] != actual:
            raise UserError(f"{path}: {field} is {config[field]}, but {BACKBONE_PREFIX}{name} has size {actual} "
                            f"in dimension {dim}")
    if "n_blocks" in config and config["n_blocks"] != _block_count(tensors):
        raise UserError(f"{path}: n_blocks is {config['n_blocks']}, but the weights hold "
                        f"{_block_count(tensors)} blocks")


def _config_int(config: Mapping[str, Any], field: str, where: Path) -> int:
    value = config.get(field)
    if type(value) is not int or value < 1:
        raise UserError(f"{where}: {field} is {value!r}, expected a positive integer")
    return value


# ------------------------------------------------------------------ Lightning checkpoint
def _read_lightning(path: Path, weights: WeightsChoice) -> tuple[dict[str, torch.Tensor], MdlmHyperParameters, dict]:
    if weights not in ("ema", "model"):
        raise UserError(f"--weights must be 'ema' or 'model', got {weights!r}")
    with InertArchive(path) as archive:
        root = archive.root()
        if not isinstance(root, dict) or not isinstance(root.get("state_dict"), Mapping):
            raise UserError(f"{path}: no state_dict: not a Lightning checkpoint")
        refs = _backbone(root["state_dict"], path)
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
    parameter order (``mdlm_parameter_names``); buffers (the rotary frequencies) have no EMA."""
    if not isinstance(ema, dict) or not isinstance(ema.get("shadow_params"), list):
        raise UserError(f"{path}: holds no EMA (no ema.shadow_params); import its live weights with --weights model")
    names = [theirs for theirs, _ in mdlm_parameter_names(_block_count(live))]
    shadows = ema["shadow_params"]
    if len(shadows) != len(names):
        raise UserError(f"{path}: ema.shadow_params holds {len(shadows)} tensors, but MDLM's DiT with "
                        f"{_block_count(live)} blocks has {len(names)} parameters")
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


def _hyper_parameters(record: Any, path: Path) -> MdlmHyperParameters:
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
    noise_type = noise.get("type", MDLM_SCHEDULE) if isinstance(noise, dict) else MDLM_SCHEDULE
    if time_conditioning and noise_type != MDLM_SCHEDULE:
        raise UserError(f"{where}.noise.type is {noise_type!r}: a time-conditioned model is imported under the "
                        f"log-linear noise only (it sees sigma(t) of that schedule)")
    for field in ("n_heads", "length"):
        if type(model.get(field)) is not int or model[field] < 1:
            raise UserError(f"{where}.model.{field} is {model.get(field)!r}, expected a positive integer")
    return MdlmHyperParameters(n_heads=model["n_heads"], max_seq_len=model["length"],
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


# ------------------------------------------------------------------ checks and renaming
def _backbone(record: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The entries of ``record`` without their ``backbone.`` prefix; any other entry is refused."""
    others = [key for key in record if not (isinstance(key, str) and key.startswith(BACKBONE_PREFIX))]
    if others:
        raise UserError(f"{path}: unknown tensor {others[0]!r}: MDLM's weights all lie under {BACKBONE_PREFIX!r}")
    return {key[len(BACKBONE_PREFIX):]: value for key, value in record.items()}


def _renamed(tensors: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Our network's state dict from MDLM's tensors; every tensor accounted for, every shape checked."""
    _check_rotary(tensors, spec.network)
    names = mdlm_parameter_names(spec.network.n_layers)
    known = {theirs for theirs, _ in names} | {ROTARY_BUFFER}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise UserError(f"unknown tensor {BACKBONE_PREFIX}{unknown[0]}: not part of MDLM's DiT"
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
    """The rotary frequencies a checkpoint carries are MDLM's (base 10000), which the network rebuilds."""
    if ROTARY_BUFFER not in tensors:
        return
    head_dim = network.head_dim
    expected = 1.0 / (MDLM_ROTARY_BASE ** (torch.arange(0, head_dim, 2).float() / head_dim))
    found = tensors[ROTARY_BUFFER]
    if found.shape != expected.shape or not torch.allclose(found.float(), expected, rtol=1e-6, atol=0):
        raise UserError(f"{BACKBONE_PREFIX}{ROTARY_BUFFER} is not the rotary frequencies of base "
                        f"{MDLM_ROTARY_BASE:g} for heads of {head_dim} (shape {tuple(found.shape)}): a different "
                        "rotary embedding, or n_heads is not the model's")


def _block_count(tensors: Mapping[str, Any]) -> int:
    indices = {int(match.group(1)) for name in tensors if (match := _BLOCK_KEY.match(name))}
    if not indices or indices != set(range(max(indices) + 1)):
        raise UserError(f"the weights' blocks are not numbered 0..N-1: {sorted(indices)[:10]}")
    return max(indices) + 1


def _named(tensors: Mapping[str, Any], name: str, *, dims: int) -> Any:
    if name not in tensors:
        raise UserError(f"missing tensor {BACKBONE_PREFIX}{name}")
    shape = tuple(tensors[name].shape)
    if len(shape) != dims:
        raise UserError(f"{BACKBONE_PREFIX}{name} has shape {shape}, expected {dims} dimensions")
    return tensors[name]


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


def _write(out: Path, tensors: dict[str, torch.Tensor], config: dict, tokenizer: Tokenizer) -> None:
    """The export, with the tokenizer's own files only (not whatever else its directory holds)."""
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = Path(scratch) / "tokenizer"
        tokenizer.save(tokenizer_dir)
        write_export(out, tensors, config, tokenizer_dir)
