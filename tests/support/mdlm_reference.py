"""MDLM's DiT, independently: a reference forward written from its equations, and its two
checkpoint layouts built from random weights.

The reference follows the paper's network (Sahoo et al. 2024, appendix: the DiT of SEDD) as
MDLM's ``models/dit.py`` computes it in float32, and shares no code with
``model.transformer``:

    c        = SiLU(W2 SiLU(W1 [cos(sigma f), sin(sigma f)] + b1) + b2),  f_k = 10000^(-k/128), k < 128
               sigma = 0 when the model is not time-conditioned
    h        = E[x]                                                       E: (V+1) x d
    per block, (s1, a1, g1, s2, a2, g2) = W_ada c + b_ada:
      u      = LN(h) * w1 * (1 + a1) + s1                                 LN: no affine, eps 1e-5
      q,k,v  = split(u W_qkv^T), heads of size d_h; q, k rotated: x cos + rotate_half(x) sin,
               angles p * 10000^(-2i/d_h) in float32, duplicated over both halves
      h      = h + g1 * (softmax(q k^T / sqrt(d_h)) v) W_out^T
      h      = h + g2 * MLP(LN(h) * w2 * (1 + a2) + s2),   MLP = W_b GELU_tanh(W_a . + b_a) + b_b
    (s, a)   = W_f c + b_f;  logits = (LN(h) * w_f * (1 + a) + s) W_o^T + b_o     (V + 1 of them)
    SUBS     : the mask's logit gets -1e6 before the log-softmax.

Layouts: a Hugging Face directory (``config.json`` + ``model.safetensors``, keys prefixed
``backbone.``) and a Lightning ``.ckpt`` (``state_dict``, ``ema.shadow_params`` in parameter
order, ``hyper_parameters`` holding an OmegaConf-like config and a tokenizer object, the
optimizer's state). The ``.ckpt``'s hyper-parameters pickle as classes of modules that do not
exist here (``omegaconf.dictconfig``), as a real one does, plus a ``__reduce__`` payload.
"""

from __future__ import annotations

import json
import math
import os
import sys
import types
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

NEG_INFINITY = -1_000_000.0  # what MDLM adds to the mask's logit
LOGLINEAR_EPS = 1e-3
FREQUENCIES = 256            # MDLM's TimestepEmbedder


@dataclass(frozen=True)
class DiTShape:
    vocab_size: int          # V: clean tokens; the mask is V
    width: int = 64
    n_heads: int = 4
    n_blocks: int = 2
    cond_dim: int = 32
    length: int = 32         # model_length
    time_conditioning: bool = False


def sigma_of(t: torch.Tensor) -> torch.Tensor:
    """MDLM's log-linear total noise at time t."""
    return -torch.log1p(-(1 - LOGLINEAR_EPS) * t)


def random_weights(shape: DiTShape, seed: int) -> OrderedDict[str, torch.Tensor]:
    """MDLM's backbone parameters (names without ``backbone.``) in its registration order,
    random, scaled so that every term matters."""
    g = torch.Generator().manual_seed(seed)
    d, c, rows = shape.width, shape.cond_dim, shape.vocab_size + 1

    def r(*size: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*size, generator=g) * std

    w = OrderedDict()
    w["vocab_embed.embedding"] = r(rows, d, std=0.3)
    w["sigma_map.mlp.0.weight"], w["sigma_map.mlp.0.bias"] = r(c, FREQUENCIES), r(c)
    w["sigma_map.mlp.2.weight"], w["sigma_map.mlp.2.bias"] = r(c, c, std=0.3), r(c)
    for i in range(shape.n_blocks):
        p = f"blocks.{i}."
        w[p + "norm1.weight"] = 1 + r(d)
        w[p + "attn_qkv.weight"] = r(3 * d, d, std=0.2)
        w[p + "attn_out.weight"] = r(d, d)
        w[p + "norm2.weight"] = 1 + r(d)
        w[p + "mlp.0.weight"], w[p + "mlp.0.bias"] = r(4 * d, d), r(4 * d)
        w[p + "mlp.2.weight"], w[p + "mlp.2.bias"] = r(d, 4 * d), r(d)
        w[p + "adaLN_modulation.weight"], w[p + "adaLN_modulation.bias"] = r(6 * d, c), r(6 * d, std=0.2)
    w["output_layer.norm_final.weight"] = 1 + r(d)
    w["output_layer.linear.weight"], w["output_layer.linear.bias"] = r(rows, d), r(rows)
    w["output_layer.adaLN_modulation.weight"] = r(2 * d, c)
    w["output_layer.adaLN_modulation.bias"] = r(2 * d, std=0.2)
    return w


def rotary_inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / (10_000 ** (torch.arange(0, head_dim, 2).float() / head_dim))


def reference_log_probs(w: dict[str, torch.Tensor], shape: DiTShape, x: torch.Tensor,
                        sigma: torch.Tensor) -> torch.Tensor:
    """MDLM's SUBS log-probabilities [B, L, V + 1] of the DiT ``w`` (module docstring), before
    the carry-over of unmasked tokens."""
    logits = reference_logits(w, shape, x, sigma)
    logits[..., shape.vocab_size] += NEG_INFINITY
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)


def reference_logits(w: dict[str, torch.Tensor], shape: DiTShape, x: torch.Tensor,
                     sigma: torch.Tensor) -> torch.Tensor:
    """The DiT's V + 1 raw logits (module docstring)."""
    batch, length = x.shape
    d, heads = shape.width, shape.n_heads
    head_dim = d // heads
    if not shape.time_conditioning:
        sigma = torch.zeros_like(sigma)
    half = FREQUENCIES // 2
    freqs = torch.exp(-math.log(10_000) * torch.arange(half, dtype=torch.float32) / half)
    arguments = sigma.float()[:, None] * freqs[None]
    features = torch.cat([arguments.cos(), arguments.sin()], dim=-1)
    c = F.silu(F.linear(F.silu(F.linear(features, w["sigma_map.mlp.0.weight"], w["sigma_map.mlp.0.bias"])),
                        w["sigma_map.mlp.2.weight"], w["sigma_map.mlp.2.bias"]))
    angles = torch.outer(torch.arange(length).float(), rotary_inv_freq(head_dim))
    both_halves = torch.cat([angles, angles], -1)[None, :, None]  # [1, L, 1, head_dim]
    cos, sin = both_halves.cos(), both_halves.sin()

    def norm(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(h, [d]) * weight

    def rotate(u: torch.Tensor) -> torch.Tensor:  # [B, L, H, head_dim]
        u1, u2 = u[..., : head_dim // 2], u[..., head_dim // 2:]
        return u * cos + torch.cat([-u2, u1], dim=-1) * sin

    h = w["vocab_embed.embedding"][x]
    for i in range(shape.n_blocks):
        p = f"blocks.{i}."
        s1, a1, g1, s2, a2, g2 = F.linear(c, w[p + "adaLN_modulation.weight"],
                                          w[p + "adaLN_modulation.bias"])[:, None].chunk(6, dim=-1)
        u = norm(h, w[p + "norm1.weight"]) * (1 + a1) + s1
        q, k, v = F.linear(u, w[p + "attn_qkv.weight"]).view(batch, length, 3, heads, head_dim).unbind(2)
        q, k = rotate(q), rotate(k)
        scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(head_dim)
        mixed = torch.einsum("bhqk,bkhe->bqhe", scores.softmax(-1), v).reshape(batch, length, d)
        h = h + g1 * F.linear(mixed, w[p + "attn_out.weight"])
        u = norm(h, w[p + "norm2.weight"]) * (1 + a2) + s2
        u = F.linear(F.gelu(F.linear(u, w[p + "mlp.0.weight"], w[p + "mlp.0.bias"]), approximate="tanh"),
                     w[p + "mlp.2.weight"], w[p + "mlp.2.bias"])
        h = h + g2 * u
    shift, scale = F.linear(c, w["output_layer.adaLN_modulation.weight"],
                            w["output_layer.adaLN_modulation.bias"])[:, None].chunk(2, dim=-1)
    h = norm(h, w["output_layer.norm_final.weight"]) * (1 + scale) + shift
    return F.linear(h, w["output_layer.linear.weight"], w["output_layer.linear.bias"])


# ------------------------------------------------------------------------- layouts
def backbone_state(w: dict[str, torch.Tensor], shape: DiTShape) -> OrderedDict[str, torch.Tensor]:
    """The ``backbone.``-prefixed state dict, with the rotary buffer where MDLM registers it."""
    state = OrderedDict()
    for name, tensor in w.items():
        if name.startswith("blocks.0.") and "backbone.rotary_emb.inv_freq" not in state:
            state["backbone.rotary_emb.inv_freq"] = rotary_inv_freq(shape.width // shape.n_heads)
        state["backbone." + name] = tensor
    return state


def write_hugging_face(directory: Path, w: dict[str, torch.Tensor], shape: DiTShape) -> Path:
    """MDLM's Hugging Face layout (kuleshov-group/mdlm-owt)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["MDLM"], "auto_map": {"AutoConfig": "configuration_mdlm.MDLMConfig",
                                                      "AutoModelForMaskedLM": "modeling_mdlm.MDLM"},
              "model_type": "mdlm", "vocab_size": shape.vocab_size + 1, "model_length": shape.length,
              "hidden_dim": shape.width, "cond_dim": shape.cond_dim, "n_blocks": shape.n_blocks,
              "n_heads": shape.n_heads, "dropout": 0.1, "time_conditioning": shape.time_conditioning,
              "return_dict": False, "torch_dtype": "float32"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(dict(backbone_state(w, shape)), str(directory / "model.safetensors"))
    return directory


class Payload:
    """Pickles as a call to os.system: what a booby-trapped checkpoint carries."""

    def __init__(self, marker: Path) -> None:
        self.command = f"touch {marker}"

    def __reduce__(self):
        return os.system, (self.command,)


class DictConfig:  # pickles as omegaconf.dictconfig.DictConfig does: NEWOBJ, then its __dict__
    __module__ = "omegaconf.dictconfig"

    def __init__(self, content: dict, parent: object = None) -> None:
        self._metadata, self._parent = {"ref_type": "Any"}, parent
        self._content = {key: DictConfig(value, self) if isinstance(value, dict) else AnyNode(value, self)
                         for key, value in content.items()}


class AnyNode:  # omegaconf.nodes.AnyNode: the value in _val
    __module__ = "omegaconf.nodes"

    def __init__(self, value: object, parent: object) -> None:
        self._val, self._metadata, self._parent = value, {"optional": True}, parent


class GPT2TokenizerFast:  # a tokenizer object, as MDLM's save_hyperparameters() pickles it
    __module__ = "transformers.models.gpt2.tokenization_gpt2_fast"

    def __init__(self) -> None:
        self.name_or_path, self.vocab_files = "gpt2", {"vocab_file": "vocab.json"}


def _fake_modules() -> dict[str, types.ModuleType]:
    """Modules (and their parent packages) that make the classes above picklable under their
    libraries' names; a real module of such a name is only shadowed while saving."""
    modules = {}
    for cls in (DictConfig, AnyNode, GPT2TokenizerFast):
        parts = cls.__module__.split(".")
        for depth in range(1, len(parts)):
            parent = ".".join(parts[:depth])
            if parent not in sys.modules:
                modules.setdefault(parent, types.ModuleType(parent))
        modules.setdefault(cls.__module__, types.ModuleType(cls.__module__))
        setattr(modules[cls.__module__], cls.__name__, cls)
    return modules


def mdlm_config(shape: DiTShape, **overrides) -> dict:
    """The parts of MDLM's Hydra config the importer reads, with others around them."""
    config = {"mode": "train", "diffusion": "absorbing_state", "backbone": "dit", "parameterization": "subs",
              "time_conditioning": shape.time_conditioning, "T": 0, "subs_masking": False,
              "model": {"name": "small", "type": "ddit", "hidden_size": shape.width, "cond_dim": shape.cond_dim,
                        "length": shape.length, "n_blocks": shape.n_blocks, "n_heads": shape.n_heads,
                        "scale_by_sigma": True, "dropout": 0.1, "tie_word_embeddings": False},
              "noise": {"type": "loglinear", "sigma_min": 1e-4, "sigma_max": 20},
              "training": {"ema": 0.9999, "antithetic_sampling": True, "sampling_eps": 1e-3}}
    config.update(overrides)
    return config


def write_lightning(path: Path, live: dict[str, torch.Tensor], ema: dict[str, torch.Tensor], shape: DiTShape,
                    marker: Path, *, config: dict | None = None, with_ema: bool = True) -> Path:
    """A ``.ckpt`` as MDLM's Lightning training writes it; unpickling it for real would run
    ``touch marker`` (and need omegaconf and transformers)."""
    modules = _fake_modules()
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        checkpoint = {
            "epoch": 0, "global_step": 1234, "pytorch-lightning_version": "2.2.1",
            "state_dict": backbone_state(live, shape),
            "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}}},
            "callbacks": {"ModelCheckpoint": {"best_model_path": "", "payload": Payload(marker)}},
            "optimizer_states": [{"state": {i: {"step": torch.tensor(1234.0), "exp_avg": torch.zeros_like(t),
                                                "exp_avg_sq": torch.ones_like(t)} for i, t in enumerate(live.values())},
                                  "param_groups": [{"lr": 3e-4, "params": list(range(len(live)))}]}],
            "lr_schedulers": [{"last_epoch": 1234}],
            "hyper_parameters": {"config": DictConfig(config or mdlm_config(shape)),
                                 "tokenizer": GPT2TokenizerFast()},
            "sampler": {"random_state": Payload(marker)},
        }
        if with_ema:
            checkpoint["ema"] = {"decay": 0.9999, "num_updates": 1234, "shadow_params": list(ema.values())}
        torch.save(checkpoint, path)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return path
