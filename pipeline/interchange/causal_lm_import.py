"""A Hugging Face causal LM directory read as unmask's autoregressive network: ``read_causal_lm``.

The directory is what ``save_pretrained`` writes: ``config.json``, ``model.safetensors`` (or
the shards that ``model.safetensors.index.json`` names) and ``tokenizer.json`` (its roles from
``special_tokens_map.json`` or ``tokenizer_config.json`` beside it). ``FAMILIES`` are the
architectures mapped exactly: GPT-2's (``GPT2LMHeadModel``: gpt2, gpt2-medium, distilgpt2:
learned positions, LayerNorms with biases, Conv1D weights transposed, the tied head) and
Llama's (``LlamaForCausalLM``, ``Qwen2ForCausalLM``: SmolLM2, Qwen2.5: RMSNorm, SwiGLU,
grouped-query attention, RoPE at the config's theta, Qwen2's query/key/value biases), each onto
``model.transformer.FamilyLayers``. The result is our autoregressive baseline's network
(``causal=True``) over the tokenizer's V tokens, its start row (id V) a copy of the embedding
of the token a text starts from (the tokenizer's BOS, else its EOS): its next-token logits on
[start, x] are the source's on [BOS, x]. Nothing is downloaded and nothing read runs code
(JSON and safetensors); a directory that is not a causal LM, another architecture, an option
the mapping does not reproduce, a tensor that does not fit or a tokenizer that is not the
model's is refused in one line naming it. docs/adapting.md#sources.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from common.errors import UserError
from common.file_records import sha256_file
from common.outputs import json_object
from data_prep.tokenizer.hugging_face import TOKENIZER_JSON_FILE, HuggingFaceTokenizer
from model.transformer import FamilyLayers, TransformerConfig

__all__ = ["CONFIG_FILE", "FAMILIES", "INDEX_FILE", "WEIGHTS_FILE", "CausalLM", "is_hugging_face_model",
           "read_causal_lm"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # sharded weights: {"weight_map": {tensor: shard file}}
# config.json's model_type -> the causal LM class whose network this module reproduces.
FAMILIES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# transformers' GELU activations that are the tanh approximation (ours).
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
_LAYER = re.compile(r"^(?:h|layers)\.(\d+)\.")


@dataclass(frozen=True)
class CausalLM:
    """A causal LM read from its directory (module docstring)."""

    path: Path
    family: str                     # config.json's model_type: a key of FAMILIES
    network: TransformerConfig      # the autoregressive baseline's network (causal) over the tokenizer's V tokens
    tensors: dict[str, Tensor]      # float32, our names; embed.weight [V + 1, d], row V the start token's
    tokenizer: HuggingFaceTokenizer
    start_token: int                # the source's id whose embedding row V copies
    weights_file: str               # what ``weights_sha256`` is of: the weights file, or the shards' index
    weights_sha256: str


def is_hugging_face_model(path: Path) -> bool:
    """Whether ``path`` is a directory whose config.json is a Hugging Face model's (a ``model_type``)."""
    config = json_object(Path(path) / CONFIG_FILE)
    return config is not None and "model_type" in config


def read_causal_lm(path: str | Path, flag: str = "--init-from") -> CausalLM:
    """The causal LM in the directory ``path``; ``flag`` names it in the errors."""
    path = Path(path)
    config = _config(path, flag)
    family = _family(config, path, flag)
    tokenizer = _tokenizer(path, flag)
    raw, weights_file, sha256 = _weights(path, flag)
    network = _NETWORKS[family](config, tokenizer.vocab_size, _Where(path, flag))
    tensors = _MAPPINGS[family](_without_prefix(raw, _PREFIXES[family]), network, _Where(path, flag))
    start = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    tensors = _vocabulary_rows(tensors, network, start, _Where(path, flag))
    return CausalLM(path, family, network, tensors, tokenizer, start, weights_file, sha256)


@dataclass(frozen=True)
class _Where:
    """The directory and the flag naming it, for the errors."""

    path: Path
    flag: str

    def error(self, problem: str) -> UserError:
        return UserError(f"{self.flag} {self.path}: {problem}")


# ---------------------------------------------------------------------- the directory
def _config(path: Path, flag: str) -> dict[str, Any]:
    where = _Where(path, flag)
    if not path.is_dir():
        raise where.error("not a directory; give a Hugging Face causal LM's directory (config.json, "
                          "model.safetensors, tokenizer.json)")
    config_path = path / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise where.error(f"no {CONFIG_FILE}: not a Hugging Face model directory") from None
    except (OSError, ValueError) as err:
        raise where.error(f"{CONFIG_FILE} is not readable JSON ({err})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise where.error(f"{CONFIG_FILE} names no model_type: not a Hugging Face model's config")
    return config


def _family(config: dict, path: Path, flag: str) -> str:
    """The family of a causal LM whose network ``FAMILIES`` maps; one line for anything else."""
    model_type, architectures = config["model_type"], config.get("architectures") or []
    supported = ", ".join(f"{cls} ({kind})" for kind, cls in FAMILIES.items())
    causal = [name for name in architectures if str(name).endswith(("ForCausalLM", "LMHeadModel"))]
    if model_type in FAMILIES and (not architectures or FAMILIES[model_type] in architectures):
        return model_type
    if causal:
        raise _Where(path, flag).error(f"the architecture {causal[0]} (model_type {model_type!r}) is not one "
                                       f"unmask adapts; supported: {supported}")
    named = f"architectures {architectures}" if architectures else f"model_type {model_type!r}"
    raise _Where(path, flag).error(f"not a causal language model ({named}); give a causal LM of one of "
                                   f"{supported}")


def _tokenizer(path: Path, flag: str) -> HuggingFaceTokenizer:
    file = path / TOKENIZER_JSON_FILE
    if not file.is_file():
        raise _Where(path, flag).error(f"no {TOKENIZER_JSON_FILE} (the tokenizer the model was trained with, as "
                                       "save_pretrained writes it); save the model's tokenizer beside it")
    return HuggingFaceTokenizer.from_file(file)


def _weights(path: Path, flag: str) -> tuple[dict[str, Tensor], str, str]:
    """The tensors (float32), the file they are recorded by and its sha256 (of a sharded
    model: the sha256 of its shards' sha256s, in the index's order of files)."""
    where = _Where(path, flag)
    if (path / WEIGHTS_FILE).is_file():
        files, recorded = [path / WEIGHTS_FILE], WEIGHTS_FILE
    elif (path / INDEX_FILE).is_file():
        index = json_object(path / INDEX_FILE) or {}
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise where.error(f"{INDEX_FILE} has no weight_map")
        files, recorded = [path / name for name in sorted(set(weight_map.values()))], INDEX_FILE
    else:
        raise where.error(f"no {WEIGHTS_FILE} (nor {INDEX_FILE}): unmask reads safetensors weights only "
                          "(docs/security.md)")
    tensors: dict[str, Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError) as err:
            raise where.error(f"{file.name} is not a readable safetensors file ({err})") from None
    hashes = [sha256_file(file) for file in files]
    sha256 = hashes[0] if len(hashes) == 1 else hashlib.sha256("".join(hashes).encode()).hexdigest()
    return {name: tensor.float() for name, tensor in tensors.items()}, recorded, sha256


def _without_prefix(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The tensors of the model body without its class's prefix (GPT-2's hub files have none)."""
    return {name.removeprefix(prefix): tensor for name, tensor in tensors.items()}


# ---------------------------------------------------------------------- the networks
def _field(config: dict, name: str, where: _Where, kind: type = int) -> Any:
    value = config.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise where.error(f"{CONFIG_FILE} field {name} = {value!r}: expected {kind.__name__}")
    return value


def _require(config: dict, name: str, allowed: tuple, default: Any, where: _Where) -> None:
    """A config option whose other values this mapping does not reproduce."""
    value = config.get(name, default)
    if value not in allowed:
        raise where.error(f"{CONFIG_FILE} field {name} = {value!r}: unmask reproduces {name} "
                          f"{' or '.join(repr(a) for a in allowed)} only")


def _network(where: _Where, **fields: Any) -> TransformerConfig:
    try:
        return TransformerConfig(causal=True, **fields)
    except ValueError as err:
        raise where.error(f"{CONFIG_FILE}: {err}") from None


def _gpt2_network(config: dict, vocab_size: int, where: _Where) -> TransformerConfig:
    _require(config, "activation_function", GPT2_ACTIVATIONS, "gelu_new", where)
    _require(config, "scale_attn_weights", (True,), True, where)
    _require(config, "scale_attn_by_inverse_layer_idx", (False,), False, where)
    _require(config, "add_cross_attention", (False,), False, where)
    width, positions = _field(config, "n_embd", where), _field(config, "n_positions", where)
    hidden = config.get("n_inner") or 4 * width
    return _network(where, vocab_size=vocab_size, n_layers=_field(config, "n_layer", where), d_model=width,
                    n_heads=_field(config, "n_head", where), max_seq_len=positions,
                    norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
                    init_std=float(config.get("initializer_range", 0.02)),
                    tie_weights=config.get("tie_word_embeddings", True), mlp_bias=True,
                    family=FamilyLayers(learned_positions=positions, norm_bias=True, mlp_hidden=hidden,
                                        qkv_bias=True, out_bias=True))


def _rope_theta(config: dict, where: _Where) -> float:
    """RoPE's base: ``rope_theta`` (transformers 4) or ``rope_parameters`` (5); default RoPE only."""
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind != "default":
        raise where.error(f"{CONFIG_FILE}: RoPE scaling {kind!r} (rope_parameters / rope_scaling): unmask "
                          "reproduces the default RoPE only")
    return float(config.get("rope_theta") or parameters.get("rope_theta") or 10_000.0)


def _llama_network(config: dict, vocab_size: int, where: _Where) -> TransformerConfig:
    _require(config, "hidden_act", ("silu",), "silu", where)
    qwen = config["model_type"] == "qwen2"
    if qwen:
        _require(config, "use_sliding_window", (False,), False, where)
    width, heads = _field(config, "hidden_size", where), _field(config, "num_attention_heads", where)
    if config.get("head_dim") not in (None, width // heads):
        raise where.error(f"{CONFIG_FILE} field head_dim = {config['head_dim']}: unmask's heads are "
                          f"hidden_size / num_attention_heads = {width // heads} wide")
    attention_bias = bool(config.get("attention_bias", False))
    return _network(where, vocab_size=vocab_size, n_layers=_field(config, "num_hidden_layers", where), d_model=width,
                    n_heads=heads, max_seq_len=_field(config, "max_position_embeddings", where),
                    rope_base=_rope_theta(config, where), rope_angles="float32",
                    norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                    init_std=float(config.get("initializer_range", 0.02)),
                    tie_weights=bool(config.get("tie_word_embeddings", False)),
                    mlp_bias=bool(config.get("mlp_bias", False)),
                    family=FamilyLayers(norm="rmsnorm", mlp="swiglu",
                                        mlp_hidden=_field(config, "intermediate_size", where),
                                        kv_heads=config.get("num_key_value_heads") or heads,
                                        qkv_bias=qwen or attention_bias, out_bias=attention_bias and not qwen))


# ---------------------------------------------------------------------- the tensors
class _Tensors:
    """The source's tensors, taken by name: what is left at the end is refused."""

    def __init__(self, tensors: dict[str, Tensor], where: _Where) -> None:
        self.left, self.where = dict(tensors), where

    def take(self, name: str, shape: tuple[int, ...] | None = None) -> Tensor:
        tensor = self.left.pop(name, None)
        if tensor is None:
            raise self.where.error(f"{WEIGHTS_FILE} has no tensor {name} (a model saved by another class, or "
                                   "damaged)")
        if shape is not None and tuple(tensor.shape) != shape:
            raise self.where.error(f"tensor {name} has shape {list(tensor.shape)}, but {CONFIG_FILE} makes it "
                                   f"{list(shape)}")
        return tensor

    def take_if(self, name: str, present: bool, shape: tuple[int, ...]) -> Tensor | None:
        return self.take(name, shape) if present else None

    def finish(self, ignored: Callable[[str], bool]) -> None:
        """Refuse a tensor nothing took (other than buffers ``ignored`` names)."""
        unknown = sorted(name for name in self.left if not ignored(name))
        if unknown:
            raise self.where.error(f"tensor {unknown[0]} is not one of the {CONFIG_FILE} network's (an option "
                                   "unmask does not reproduce)")


def _put(out: dict[str, Tensor], name: str, tensor: Tensor | None) -> None:
    if tensor is not None:
        out[name] = tensor.contiguous()


def _source_rows(config: TransformerConfig, tensors: _Tensors, name: str) -> Tensor:
    """The token embedding (all the source's rows: checked against the vocabulary later)."""
    embedding = tensors.take(name)
    if embedding.dim() != 2 or embedding.shape[1] != config.d_model:
        raise tensors.where.error(f"tensor {name} has shape {list(embedding.shape)}, not [rows, {config.d_model}]")
    return embedding


def _gpt2_tensors(raw: dict[str, Tensor], network: TransformerConfig, where: _Where) -> dict[str, Tensor]:
    """GPT-2's tensors by our names: Conv1D weights are [in, out], our Linear's [out, in]."""
    tensors, out = _Tensors(raw, where), {}
    d, hidden, family = network.d_model, network.mlp_hidden, network.family
    out["embed.weight"] = _source_rows(network, tensors, "wte.weight")
    _put(out, "positions.weight", tensors.take("wpe.weight", (family.learned_positions, d)))
    for i in range(network.n_layers):
        theirs, ours = f"h.{i}.", f"blocks.{i}."
        for norm, name in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
            _put(out, f"{ours}{name}.weight", tensors.take(f"{theirs}{norm}.weight", (d,)))
            _put(out, f"{ours}{name}.bias", tensors.take(f"{theirs}{norm}.bias", (d,)))
        for conv, name, shape in (("attn.c_attn", "attn.qkv", (d, 3 * d)), ("attn.c_proj", "attn.out", (d, d)),
                                  ("mlp.c_fc", "mlp.up", (d, hidden)), ("mlp.c_proj", "mlp.down", (hidden, d))):
            _put(out, f"{ours}{name}.weight", tensors.take(f"{theirs}{conv}.weight", shape).t())
            _put(out, f"{ours}{name}.bias", tensors.take(f"{theirs}{conv}.bias", (shape[1],)))
    _put(out, "final_norm.weight", tensors.take("ln_f.weight", (d,)))
    _put(out, "final_norm.bias", tensors.take("ln_f.bias", (d,)))
    _head(out, tensors, network, "lm_head.weight")
    # Old checkpoints carry the attention's causal-mask buffers.
    tensors.finish(lambda name: name.endswith((".attn.bias", ".attn.masked_bias")) and _LAYER.match(name) is not None)
    return out


def _llama_tensors(raw: dict[str, Tensor], network: TransformerConfig, where: _Where) -> dict[str, Tensor]:
    """Llama's and Qwen2's tensors by our names: q, k and v stacked into our one projection."""
    tensors, out = _Tensors(raw, where), {}
    d, hidden, family = network.d_model, network.mlp_hidden, network.family
    kv_width = network.kv_heads * network.head_dim
    out["embed.weight"] = _source_rows(network, tensors, "embed_tokens.weight")
    for i in range(network.n_layers):
        theirs, ours = f"layers.{i}.", f"blocks.{i}."
        _put(out, f"{ours}attn_norm.weight", tensors.take(f"{theirs}input_layernorm.weight", (d,)))
        _put(out, f"{ours}mlp_norm.weight", tensors.take(f"{theirs}post_attention_layernorm.weight", (d,)))
        widths = {"q": d, "k": kv_width, "v": kv_width}
        _put(out, f"{ours}attn.qkv.weight", torch.cat([tensors.take(f"{theirs}self_attn.{p}_proj.weight", (w, d))
                                                        for p, w in widths.items()]))
        if family.qkv_bias:
            _put(out, f"{ours}attn.qkv.bias", torch.cat([tensors.take(f"{theirs}self_attn.{p}_proj.bias", (w,))
                                                          for p, w in widths.items()]))
        _put(out, f"{ours}attn.out.weight", tensors.take(f"{theirs}self_attn.o_proj.weight", (d, d)))
        _put(out, f"{ours}attn.out.bias", tensors.take_if(f"{theirs}self_attn.o_proj.bias", family.out_bias, (d,)))
        for proj, name, shape in (("gate_proj", "gate", (hidden, d)), ("up_proj", "up", (hidden, d)),
                                  ("down_proj", "down", (d, hidden))):
            _put(out, f"{ours}mlp.{name}.weight", tensors.take(f"{theirs}mlp.{proj}.weight", shape))
            _put(out, f"{ours}mlp.{name}.bias", tensors.take_if(f"{theirs}mlp.{proj}.bias", network.mlp_bias,
                                                                (shape[0],)))
    _put(out, "final_norm.weight", tensors.take("norm.weight", (d,)))
    _head(out, tensors, network, "lm_head.weight")
    tensors.finish(lambda name: name.endswith("rotary_emb.inv_freq"))
    return out


def _head(out: dict[str, Tensor], tensors: _Tensors, network: TransformerConfig, name: str) -> None:
    """An untied head's rows; a tied one is the embedding (a file may still hold its copy)."""
    if network.tie_weights:
        tensors.left.pop(name, None)
        return
    out["head.weight"] = tensors.take(name)


def _vocabulary_rows(tensors: dict[str, Tensor], network: TransformerConfig, start: int,
                     where: _Where) -> dict[str, Tensor]:
    """The embedding's V token rows and the start row (row V, the start token's copy); an untied
    head's V rows. The source's rows past the tokenizer's V (padding) are dropped."""
    vocab, embedding = network.vocab_size, tensors["embed.weight"]
    rows = embedding.shape[0]
    if rows < vocab:
        raise where.error(f"its {TOKENIZER_JSON_FILE} has ids up to {vocab - 1} but the model embeds {rows} tokens "
                          f"({CONFIG_FILE} vocab_size): no row for every token, nor room for the mask id {vocab} "
                          "after them; give the tokenizer the model was trained with")
    out = dict(tensors, **{"embed.weight": torch.cat([embedding[:vocab], embedding[start:start + 1]])})
    if "head.weight" in tensors:
        head = tensors["head.weight"]
        if head.shape != embedding.shape:
            raise where.error(f"tensor lm_head.weight has shape {list(head.shape)}, not the embedding's "
                              f"{list(embedding.shape)}")
        out["head.weight"] = head[:vocab].contiguous()
    return out


_PREFIXES = {"gpt2": "transformer.", "llama": "model.", "qwen2": "model."}
_NETWORKS = {"gpt2": _gpt2_network, "llama": _llama_network, "qwen2": _llama_network}
_MAPPINGS = {"gpt2": _gpt2_tensors, "llama": _llama_tensors, "qwen2": _llama_tensors}
