"""The denoiser network: a pre-norm transformer with rotary embeddings, a pure nn.Module built from its config.

Bidirectional by default; with ``causal=True`` the same code is the autoregressive baseline
(``model.autoregressive``). Optional time conditioning by adaLN-zero, as in the DiT of SEDD and
MDLM. Input ids range over V + 1 values (the V clean tokens and the mask id V, the causal
model's start token); the logits over the V clean tokens only, so the mask is never predicted
(SUBS). Norms, rotary embeddings and the time embedding run in float32. The options for exact
imports of MDLM's and BD3-LM's DiT, the vocabulary padding (``vocab_multiple``), a pretrained
family's layers (``FamilyLayers``) and the shift of an adapted autoregressive model
(``shift``, ``model.shift``) leave unmask's own network unchanged at their defaults:
docs/model-api.md#modeltransformer, docs/adapting.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.annealing import AttentionAnnealing
from model.block_attention import AttentionLayout, BlockAttention, CleanBlocksDenoiser, training_layout
from model.cross_entropy import CompiledCrossEntropy, chunked_cross_entropy
from model.denoiser import Denoiser
from model.documents import restrict_to_documents, training_document_layout
from model.shift import shifted_input, shifted_training_layout, shifted_training_rows

__all__ = [
    "LOGLINEAR_SIGMA_EPS",
    "PRESETS",
    "ROW_MULTIPLE",
    "FamilyLayers",
    "MlpKind",
    "NormKind",
    "ParameterCounts",
    "RopeAngles",
    "TimeInput",
    "Transformer",
    "TransformerConfig",
    "count_parameters",
    "parameter_counts",
    "preset",
    "round_up",
    "unpadded_state",
]

# Frequencies of the sinusoidal time features span periods from 1 to this many units of
# t * TIME_SCALE (the DiT / transformer convention).
MAX_TIME_PERIOD = 10_000.0
# t in [0, 1] is stretched before the sinusoidal features so that their fast frequencies
# resolve differences of 1e-3 in t (DiT embeds integer steps in [0, 1000)).
TIME_SCALE = 1000.0
# The eps of the log-linear schedule whose total noise sigma(t) = -log(1 - (1 - eps) t) is the
# time input "loglinear_sigma": MDLM's LogLinearNoise, whose eps its configs never change.
LOGLINEAR_SIGMA_EPS = 1e-3
# The compiled head and loss take their rows in multiples of this (model.cross_entropy's
# CompiledCrossEntropy): tensor-core tiles divide the matmul's row count, and at most 63 rows
# of a micro-batch's thousands are padding.
ROW_MULTIPLE = 64

TimeInput = Literal["scaled_t", "loglinear_sigma"]
RopeAngles = Literal["float64", "float32"]
NormKind = Literal["layernorm", "rmsnorm"]
MlpKind = Literal["gelu", "swiglu"]


@dataclass(frozen=True)
class FamilyLayers:
    """The layer choices of a pretrained family (GPT-2's; Llama's and Qwen2's) for a network that
    computes what such a model computes, from its weights (docs/adapting.md#the-network).
    unmask's own network has none (``TransformerConfig.family`` None); the defaults are its choices."""

    learned_positions: int = 0      # rows of a learned absolute position table (GPT-2's wpe); 0: rotary
    norm: NormKind = "layernorm"    # or "rmsnorm" (Llama)
    norm_bias: bool = False         # the LayerNorms have a bias (GPT-2)
    mlp: MlpKind = "gelu"           # GELU (tanh), or "swiglu": down(silu(gate(x)) * up(x)) (Llama)
    mlp_hidden: int = 0             # the MLP's width; 0: mlp_ratio * d_model
    kv_heads: int = 0               # key and value heads (grouped-query attention); 0: n_heads
    qkv_bias: bool = False          # biases on the query, key and value projections (GPT-2, Qwen2)
    out_bias: bool = False          # a bias on the attention's output projection (GPT-2)

    def __post_init__(self) -> None:
        checks = {"learned_positions": self.learned_positions >= 0, "norm": self.norm in get_args(NormKind),
                  "mlp": self.mlp in get_args(MlpKind), "mlp_hidden": self.mlp_hidden >= 0,
                  "kv_heads": self.kv_heads >= 0}
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"FamilyLayers.{field} has an invalid value: {getattr(self, field)!r}")


def _family(value: FamilyLayers | dict | None) -> FamilyLayers | None:
    """``TransformerConfig.family`` as given, or read back from its record (a dict: config.json)."""
    if value is None or isinstance(value, FamilyLayers):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"TransformerConfig.family must be FamilyLayers, a mapping or None, got {value!r}")
    unknown = sorted(set(value) - {f.name for f in fields(FamilyLayers)})
    if unknown:
        raise ValueError(f"TransformerConfig.family has a field this unmask does not know, {unknown[0]!r}")
    return FamilyLayers(**value)


@dataclass(frozen=True)
class TransformerConfig:
    """Shape and options of the denoiser network."""

    vocab_size: int                 # V clean tokens; the mask id is V
    n_layers: int = 12
    d_model: int = 768
    n_heads: int = 12
    max_seq_len: int = 1024         # rotary tables are built up to this length
    mlp_ratio: int = 4
    dropout: float = 0.0
    time_conditioning: bool = False
    time_embed_dim: int = 128       # width of the time embedding fed to adaLN
    tie_weights: bool = True        # output head shares the first V rows of the embedding
    causal: bool = False            # True: the autoregressive baseline
    rope_base: float = 10_000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02          # GPT-2's initialisation
    # Options for exact imports (docs/model-api.md); the defaults are unmask's own network.
    mlp_bias: bool = False          # biases on the MLP's two layers
    head_bias: bool = False         # a bias on the untied head
    head_mask_row: bool = False     # the untied head has V + 1 rows; the mask's logit is never computed
    adaptive_norm: bool = False     # adaLN without time conditioning, from the embedding of time input 0
    time_frequencies: int = 0       # sinusoidal features of the time input; 0: time_embed_dim
    time_input: TimeInput = "scaled_t"  # or "loglinear_sigma": MDLM's sigma(t)
    rope_angles: RopeAngles = "float64"  # or "float32": MDLM's rounding of the rotary angles
    vocab_multiple: int = 1         # embedding and head rows padded to a multiple of this (docs/model-api.md)
    # The token id that ends a packed document (prep's EOS): attention stays inside each
    # document of the input and positions restart after it (model.documents). None: the window.
    document_separator: int | None = None
    # An adapted autoregressive model (docs/adapting.md): the row before each token predicts it, a
    # start row (embedding row V + 1) first; and the layers of the pretrained family it came from.
    shift: bool = False
    family: FamilyLayers | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", _family(self.family))
        checks = {
            "vocab_size": self.vocab_size >= 2, "n_layers": self.n_layers >= 1,
            "d_model": self.d_model >= 1, "n_heads": self.n_heads >= 1,
            "max_seq_len": self.max_seq_len >= 1, "mlp_ratio": self.mlp_ratio >= 1,
            "dropout": 0.0 <= self.dropout < 1.0, "time_embed_dim": self.time_embed_dim >= 2,
            "time_frequencies": self.time_frequencies == 0 or self.time_frequencies >= 2,
            "time_input": self.time_input in get_args(TimeInput),
            "rope_angles": self.rope_angles in get_args(RopeAngles),
            "vocab_multiple": isinstance(self.vocab_multiple, int) and self.vocab_multiple >= 1,
            "document_separator": self.document_separator is None or (
                isinstance(self.document_separator, int) and 0 <= self.document_separator < self.vocab_size),
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"TransformerConfig.{field} has an invalid value: {getattr(self, field)!r}")
        if self.d_model % self.n_heads or (self.rotary and (self.d_model // self.n_heads) % 2):
            raise ValueError(f"TransformerConfig: d_model={self.d_model} must split into n_heads="
                             f"{self.n_heads} heads of even size (rotary embeddings rotate pairs)")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"TransformerConfig: family.kv_heads={self.kv_heads} must divide n_heads={self.n_heads}")
        if not self.rotary and self.family.learned_positions < self.positions:
            raise ValueError(f"TransformerConfig: family.learned_positions={self.family.learned_positions} holds fewer "
                             f"positions than max_seq_len={self.max_seq_len} needs ({self.positions})")
        if self.shift and (self.causal or self.time_conditioning):
            raise ValueError("TransformerConfig: a shifted network is a bidirectional denoiser without time "
                             "conditioning (its causal form is the annealing's start: model.annealing)")
        if self.time_conditioning and self.causal:
            raise ValueError("TransformerConfig: the causal baseline takes no time conditioning")
        if self.shift and self.document_separator is not None:
            raise ValueError("TransformerConfig: a shifted network attends over its whole window (its start row "
                             "and shifted rows have no document form yet); document_separator must be None")
        if self.tie_weights and (self.head_bias or self.head_mask_row):
            raise ValueError("TransformerConfig: head_bias and head_mask_row need an untied head (tie_weights=False)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Heads of the keys and values (below n_heads: grouped-query attention)."""
        return (self.family.kv_heads if self.family else 0) or self.n_heads

    @property
    def mlp_hidden(self) -> int:
        """The MLP's width."""
        return (self.family.mlp_hidden if self.family else 0) or self.mlp_ratio * self.d_model

    @property
    def rotary(self) -> bool:
        """Whether positions enter through rotary embeddings (else a learned table, ``FamilyLayers``)."""
        return self.family is None or self.family.learned_positions == 0

    @property
    def positions(self) -> int:
        """Positions a forward of ``max_seq_len`` tokens takes: one more with the start row of ``shift``."""
        return self.max_seq_len + int(self.shift)

    @property
    def start_id(self) -> int | None:
        """The start row's id of a shifted network (V + 1, after the mask's), else None."""
        return self.vocab_size + 1 if self.shift else None

    @property
    def token_rows(self) -> int:
        """Rows of the embedding without padding: the V tokens, the mask and a shifted network's start."""
        return self.vocab_size + 1 + int(self.shift)

    @property
    def modulated(self) -> bool:
        """Whether the blocks and the final norm have adaLN modulation."""
        return self.time_conditioning or self.adaptive_norm

    @property
    def head_rows(self) -> int:
        """Rows of an untied head: V, or V + 1 with the mask's row (padding not counted)."""
        return self.vocab_size + int(self.head_mask_row)

    @property
    def embedding_rows(self) -> int:
        """Rows of the embedding: the V tokens, the mask (and the start), padded to ``vocab_multiple``."""
        return round_up(self.token_rows, self.vocab_multiple)

    @property
    def padded_head_rows(self) -> int:
        """Rows of an untied head, padded to ``vocab_multiple``."""
        return round_up(self.head_rows, self.vocab_multiple)

    @property
    def logit_columns(self) -> int:
        """Columns of the head's matmul: V padded to ``vocab_multiple`` (those past V are -inf)."""
        return round_up(self.vocab_size, self.vocab_multiple)


def round_up(count: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``count``."""
    return -(-count // multiple) * multiple


PRESETS: dict[str, dict] = {
    # CPU-sized: trains in seconds to minutes on two cores.
    "tiny": {"n_layers": 4, "d_model": 256, "n_heads": 4, "max_seq_len": 256},
    # GPT-2 small shape.
    "small": {"n_layers": 12, "d_model": 768, "n_heads": 12, "max_seq_len": 1024},
    # GPT-2 medium shape.
    "medium": {"n_layers": 24, "d_model": 1024, "n_heads": 16, "max_seq_len": 1024},
    # GPT-2 large and XL shapes (774M and 1.5B parameters with GPT-2's vocabulary; heads of 64).
    "large": {"n_layers": 36, "d_model": 1280, "n_heads": 20, "max_seq_len": 1024},
    "xl": {"n_layers": 48, "d_model": 1600, "n_heads": 25, "max_seq_len": 1024},
}


def preset(name: str, vocab_size: int, **overrides) -> TransformerConfig:
    """A preset shape (``tiny``, ``small``, ``medium``, ``large``, ``xl``) with any field overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(TransformerConfig(vocab_size=vocab_size, **PRESETS[name]), **overrides)


# --------------------------------------------------------------------------- layers
class LayerNorm(nn.Module):
    """LayerNorm with a weight (and with ``bias``, a bias: GPT-2's), computed in float32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), bias, self.eps).type_as(x)


class RMSNorm(nn.Module):
    """RMSNorm with a weight (Llama's), computed in float32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


def _norm(config: TransformerConfig) -> LayerNorm | RMSNorm:
    """The network's norm: unmask's LayerNorm, or its family's (``FamilyLayers.norm``)."""
    family = config.family
    if family is not None and family.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return LayerNorm(config.d_model, config.norm_eps, bias=family is not None and family.norm_bias)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), rotating pairs (i, i + head_dim/2) of each head."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float, angles_dtype: RopeAngles = "float64") -> None:
        super().__init__()
        if angles_dtype == "float32":  # MDLM's (and transformers' Llama's) rounding, step by step
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
            angles = torch.outer(torch.arange(max_seq_len).float(), inv_freq)
        else:
            inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
            angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        # Not saved in checkpoints: they are a function of the config.
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """x: [B, H, L, head_dim]; ``positions`` (LongTensor [L] or [B, L]): the position of each of the L
        rows (None: 0..L-1). Block diffusion gives its clean copy the noisy copy's positions."""
        length = x.shape[-2]
        if positions is None:
            if length > self.cos.shape[0]:
                raise ValueError(f"sequence length {length} exceeds max_seq_len {self.cos.shape[0]}")
            cos, sin = self.cos[:length], self.sin[:length]
        else:  # positions [L], or [B, L] (model.documents): one row of angles per sequence
            cos, sin = self.cos[positions], self.sin[positions]
            if positions.dim() == 2:  # [B, L, head_dim/2] -> [B, 1, L, head_dim/2], broadcast over the heads
                cos, sin = cos[:, None], sin[:, None]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class SelfAttention(nn.Module):
    """Multi-head attention; with ``kv_heads`` below ``n_heads``, grouped-query attention (each
    key and value head serves n_heads / kv_heads query heads, Llama's ``repeat_kv``)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.causal, self.dropout = (config.n_heads, config.kv_heads, config.causal,
                                                                  config.dropout)
        family = config.family
        qkv_bias, out_bias = (family.qkv_bias, family.out_bias) if family is not None else (False, False)
        self.qkv = nn.Linear(config.d_model, (config.n_heads + 2 * config.kv_heads) * config.head_dim, bias=qkv_bias)
        self.out = nn.Linear(config.d_model, config.d_model, bias=out_bias)
        self.rotary = (RotaryEmbedding(config.head_dim, config.positions, config.rope_base, config.rope_angles)
                       if config.rotary else None)

    def forward(self, x: Tensor, layout: AttentionLayout | None = None) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self._heads(self.qkv(x), batch, length)
        if layout is not None and layout.cache is not None:
            # Finished blocks' keys and values first, kept before the rotation: the window's
            # positions start at 0 wherever it slid to (model.block_attention.KVCache). The rows
            # sit last unless the layout places them (the dual cache's block, model.sampling.window).
            k, v = layout.cache.extend(self, k, v)
            if self.causal and length > 1 and k.shape[2] > length:  # SDPA's causal mask would align them top-left
                raise ValueError("a causal network reads one new row at a time after its KV cache")
            if self.rotary is not None:
                key_positions = torch.arange(k.shape[2], device=k.device)
                rows = key_positions[k.shape[2] - length:] if layout.positions is None else layout.positions
                q, k = self.rotary(q, rows), self.rotary(k, key_positions)
        elif self.rotary is not None:
            positions = None if layout is None else layout.positions
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if self.kv_heads != self.n_heads:  # [B, kv_heads, L, hd] -> [B, heads, L, hd]: every kernel takes it
            k, v = (t.repeat_interleave(self.n_heads // self.kv_heads, dim=1) for t in (k, v))
        dropout = self.dropout if self.training else 0.0
        if layout is None or layout.mask is None:
            # SDPA dispatches to flash / memory-efficient kernels on GPU. A block after its cache
            # attends to all of it and to itself: no mask; so does a causal network's one new row
            # after its cache (autoregressive decoding), whose first call, on an empty cache, is causal.
            causal = self.causal and k.shape[2] == length
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout)
        else:
            y = layout.attend(q, k, v, dropout)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))  # [B, heads, L, hd] -> [B, L, d]

    def _heads(self, qkv: Tensor, batch: int, length: int) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, heads, L, hd], k and v [B, kv_heads, L, hd] of the projection [B, L, (heads + 2 kv_heads) hd]."""
        if self.kv_heads == self.n_heads:  # [B, L, 3 d] -> [3, B, heads, L, head_dim]
            return qkv.view(batch, length, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        head_dim = qkv.shape[-1] // (self.n_heads + 2 * self.kv_heads)
        q, k, v = qkv.split([self.n_heads * head_dim, self.kv_heads * head_dim, self.kv_heads * head_dim], dim=-1)
        # [B, L, heads * hd] -> [B, heads, L, hd], and the same for the kv_heads of k and v
        return tuple(t.view(batch, length, -1, head_dim).transpose(1, 2) for t in (q, k, v))


class MLP(nn.Module):
    """GELU (tanh) between two layers; or SwiGLU, down(silu(gate(x)) * up(x)) (``FamilyLayers.mlp``)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        hidden = config.mlp_hidden
        swiglu = config.family is not None and config.family.mlp == "swiglu"
        self.gate = nn.Linear(config.d_model, hidden, bias=config.mlp_bias) if swiglu else None
        self.up = nn.Linear(config.d_model, hidden, bias=config.mlp_bias)
        self.down = nn.Linear(hidden, config.d_model, bias=config.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is not None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm block; with time conditioning, adaLN-zero modulation of both sub-layers."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = _norm(config)
        self.attn = SelfAttention(config)
        self.mlp_norm = _norm(config)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)
        # shift, scale, gate for attention and MLP
        self.modulation = nn.Linear(config.time_embed_dim, 6 * config.d_model) if config.modulated else None

    def forward(self, x: Tensor, cond: Tensor | None, layout: AttentionLayout | None = None) -> Tensor:
        if self.modulation is None:
            x = x + self.dropout(self.attn(self.attn_norm(x), layout))
            return x + self.dropout(self.mlp(self.mlp_norm(x)))
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(cond)[:, None].chunk(6, dim=-1)
        x = x + gate1 * self.dropout(self.attn(_modulate(self.attn_norm(x), shift1, scale1), layout))
        return x + gate2 * self.dropout(self.mlp(_modulate(self.mlp_norm(x), shift2, scale2)))


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


class TimeEmbedding(nn.Module):
    """Sinusoidal features of the time input (``TransformerConfig.time_input``) followed by a
    two-layer MLP (SiLU), output pre-activated."""

    def __init__(self, dim: int, frequencies: int, time_input: TimeInput) -> None:
        super().__init__()
        self.frequencies, self.time_input = frequencies, time_input
        self.mlp = nn.Sequential(nn.Linear(frequencies, dim), nn.SiLU(), nn.Linear(dim, dim), nn.SiLU())

    def forward(self, t: Tensor) -> Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(MAX_TIME_PERIOD) * torch.arange(half, device=t.device) / half)
        angles = _time_input(t.float(), self.time_input)[:, None] * freqs[None]
        features = torch.cat([angles.cos(), angles.sin()], dim=-1)
        if self.frequencies % 2:
            features = F.pad(features, (0, 1))
        return self.mlp(features.to(self.mlp[0].weight.dtype))


def _time_input(t: Tensor, kind: TimeInput) -> Tensor:
    if kind == "loglinear_sigma":  # total noise of the log-linear schedule: alpha_t = exp(-sigma)
        return -torch.log1p(-(1 - LOGLINEAR_SIGMA_EPS) * t)
    return TIME_SCALE * t


# --------------------------------------------------------------------------- network
class Transformer(nn.Module, Denoiser):
    """The denoiser: ``(z_t [B, L] ids in [0, V], t [B] or None) -> logits [B, L, V]``.

    ``forward`` also takes ``output_mask`` (bool [B, L]: logits [N, V] at its True positions
    only; their indices are read first, the forward's one host synchronization), ``targets``
    (-log p of them in float32 instead of the logits, ``chunk_rows`` rows of the head at a
    time: ``model.cross_entropy``), ``clean`` and ``block_size`` (block diffusion's forward over
    [z ; x0], its mask's kernel ``block_attention``: "dense" or "flex", document masking's too:
    ``model.documents``), ``layout`` (the block sampler's positions, mask and KV cache) and
    ``annealing`` (training an adapted model: its causal attention opening, ``model.annealing``).
    With ``config.document_separator`` every forward attends within the documents of its rows.
    All go through ``forward`` so that wrappers that only see calls (DeepSpeed's engine and
    ZeRO-3, torch.compile) see them. As a ``Denoiser``, ``logits``, ``logits_at`` and ``nll_at``
    are these calls; it is ``time_independent`` without time conditioning. ``compile_parts``
    compiles each block and the head with its loss. A shifted network (``TransformerConfig.shift``)
    reads the rows of ``model.shift`` and answers for the same L positions.
    """

    def __init__(self, config: TransformerConfig, block_attention: BlockAttention = "dense") -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.embed = _padded(nn.Embedding(config.token_rows, d), config.embedding_rows)
        # GPT-2's learned absolute positions (FamilyLayers.learned_positions); None: rotary, in the attention.
        self.positions = None if config.rotary else nn.Embedding(config.family.learned_positions, d)
        self.time_embed = (TimeEmbedding(config.time_embed_dim, config.time_frequencies or config.time_embed_dim,
                                         config.time_input) if config.modulated else None)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.final_norm = _norm(config)
        self.final_modulation = nn.Linear(config.time_embed_dim, 2 * d) if config.modulated else None
        self.head = None if config.tie_weights else _padded(nn.Linear(d, config.head_rows, bias=config.head_bias),
                                                            config.padded_head_rows)
        # -inf on the head's columns past V (the mask's row and the padding); None without them.
        padded = config.logit_columns > config.vocab_size
        mask = torch.zeros(config.logit_columns).index_fill_(0, torch.arange(config.vocab_size, config.logit_columns),
                                                             -math.inf) if padded else None
        self.register_buffer("logit_mask", mask, persistent=False)
        self._compiled_loss: CompiledCrossEntropy | None = None
        # Block diffusion's training mask, and document masking's: "dense" (SDPA) or "flex"
        # (FlexAttention, GPU); see model.block_attention. Block layouts are built once per
        # (length, block size, device); documents' per batch (model.documents).
        self.block_attention: BlockAttention = block_attention
        self._layouts: dict[tuple, AttentionLayout] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize every weight as GPT-2 does, residual projections scaled down by sqrt(2 n_layers)."""
        std = self.config.init_std
        # GPT-2: residual projections scaled down by sqrt(2 * n_layers) (two per block).
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith(("attn.out", "mlp.down"))
                rows = self.config.head_rows if module is self.head else module.weight.shape[0]
                _normal_rows(module.weight, rows, residual_std if is_residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                rows = self.config.token_rows if module is self.embed else module.weight.shape[0]
                _normal_rows(module.weight, rows, std)
            elif isinstance(module, (LayerNorm, RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        # adaLN-zero: every block starts as the identity.
        for modulation in [b.modulation for b in self.blocks] + [self.final_modulation]:
            if modulation is not None:
                nn.init.zeros_(modulation.weight)
                nn.init.zeros_(modulation.bias)

    def compile_parts(self, **compile_options) -> None:
        """Compile each block (the identical blocks share one graph) and the head with its loss
        (``CompiledCrossEntropy``), in place: parameter names, checkpoints and exports do not
        change. Not the whole forward: the selection of the masked rows has a data-dependent
        size. ``compile_options`` go to ``torch.compile``. Wrap blocks (activation
        checkpointing) before, not after. A second call does nothing."""
        if self._compiled_loss is not None:
            return
        for block in self.blocks:
            block.compile(**compile_options)
        self._compiled_loss = CompiledCrossEntropy(self._padded_logits, ROW_MULTIPLE, **compile_options)

    def forward(self, z: Tensor, t: Tensor | None = None, output_mask: Tensor | None = None,
                targets: Tensor | None = None, chunk_rows: int | None = None, clean: Tensor | None = None,
                block_size: int | None = None, layout: AttentionLayout | None = None,
                annealing: AttentionAnnealing | None = None) -> Tensor:
        """Logits [B, L, V] of ``z`` [B, L] at times ``t`` [B]; with ``output_mask`` (bool [B, L]) the
        logits [N, V] at its True positions only; with ``targets`` [N] too, -log p of them there
        instead (float32, ``chunk_rows`` rows of the head at a time)."""
        if self.config.time_conditioning and t is None:
            raise ValueError("this Transformer is time-conditioned: pass t")
        if (layout is None or layout.cache is None) and z.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {z.shape[1]} exceeds max_seq_len {self.config.max_seq_len}")
        selected = None if output_mask is None else _selected_rows(output_mask, z)
        cond = self._condition(z, t)
        length = z.shape[1]
        if clean is not None:  # block diffusion's training forward over [z ; x] (model.block_attention)
            layout = self._training_layout(z, clean, block_size, dense=annealing is not None)
        if self.config.document_separator is not None:  # attention inside each document (model.documents)
            layout = self._document_layout(z, clean, block_size, layout)
        tokens = self._rows(z, clean, block_size, layout)
        if annealing is not None:
            layout = annealing.layout(layout, tokens.shape[1], tokens.device)
        x = self._embed(tokens, layout)
        for block in self.blocks:
            x = block(x, cond, layout)
        # The rows that answer for z: the first L (the noisy half), or the layout's (model.shift).
        x = x[:, :length] if layout is None or layout.outputs is None else x.index_select(1, layout.outputs)
        x = self.final_norm(x)
        if self.final_modulation is not None:
            shift, scale = self.final_modulation(cond)[:, None].chunk(2, dim=-1)
            x = _modulate(x, shift, scale)
        if selected is not None:
            x = x.flatten(0, 1).index_select(0, selected)  # [B, L, d] -> [N, d], rows in row-major order
        if targets is None:
            return self.output_logits(x)
        if self._compiled_loss is not None:  # the same ops under torch.compile (compile_parts)
            return self._compiled_loss(x, targets, chunk_rows)
        return chunked_cross_entropy(x, targets, self._padded_logits, chunk_rows or None)

    def _rows(self, z: Tensor, clean: Tensor | None, block_size: int | None,
              layout: AttentionLayout | None) -> Tensor:
        """The ids [B, rows] a forward of z reads: z, [z ; x] for block diffusion's training, or
        a shifted network's rows (``model.shift``)."""
        if clean is not None:
            if self.config.shift:
                return shifted_training_rows(z, clean, block_size, self.config.start_id)
            return torch.cat([z, clean], dim=1)  # [B, L] + [B, L] -> [B, 2L]
        if not self.config.shift:
            return z
        cache = None if layout is None else layout.cache
        if layout is not None and cache is None:
            raise ValueError("a shifted network builds its own attention layout; a layout may only bring a KV cache")
        last = None if cache is None else cache.last_of(z.shape[0])
        lead = self.config.start_id if last is None else last
        if cache is not None and cache.append:  # a finished block's clean rows: [x_{bL'-1}, x^b without its last]
            cache.last = z[:, -1]               # the next block's group reads it first
            return shifted_input(z[:, :-1], lead)
        return shifted_input(z, lead)

    def _embed(self, tokens: Tensor, layout: AttentionLayout | None) -> Tensor:
        """The embedding of the rows' ids, plus a learned table's positions (``FamilyLayers``)."""
        x = self.embed(tokens)
        if self.positions is None:
            return x
        if layout is not None and layout.positions is not None:
            positions = layout.positions
        else:
            first = 0 if layout is None or layout.cache is None else layout.cache.length
            if first + tokens.shape[1] > self.positions.num_embeddings:
                raise ValueError(f"positions up to {first + tokens.shape[1]} exceed the learned table's "
                                 f"{self.positions.num_embeddings}")
            positions = torch.arange(first, first + tokens.shape[1], device=tokens.device)
        return x + self.positions(positions)

    def _training_layout(self, z: Tensor, clean: Tensor, block_size: int | None, dense: bool) -> AttentionLayout:
        """Block diffusion's training layout (``model.shift``'s for a shifted network); ``dense``:
        the boolean mask whatever ``block_attention`` (annealing narrows it)."""
        if clean.shape != z.shape or block_size is None:
            raise ValueError(f"clean must have z's shape {tuple(z.shape)} (got {tuple(clean.shape)}) and come "
                             "with a block_size")
        if self.config.time_conditioning or self.config.causal:
            raise ValueError("block diffusion runs a bidirectional network without time conditioning")
        kind = "dense" if dense else self.block_attention
        key = (z.shape[1], block_size, z.device, kind)
        if key not in self._layouts:
            build = shifted_training_layout if self.config.shift else training_layout
            self._layouts[key] = build(z.shape[1], block_size, z.device, kind)
        return self._layouts[key]

    def _document_layout(self, z: Tensor, clean: Tensor | None, block_size: int | None,
                         layout: AttentionLayout | None) -> AttentionLayout:
        separator = self.config.document_separator
        if z.shape[1] > self.config.max_seq_len:  # positions restart per document, the window stays the limit
            raise ValueError(f"sequence length {z.shape[1]} exceeds max_seq_len {self.config.max_seq_len}")
        if layout is not None and clean is None:  # a sampler's layout
            return restrict_to_documents(layout, z, separator)
        return training_document_layout(z, clean, separator, self.block_attention, causal=self.config.causal,
                                        block_size=block_size)

    def _condition(self, z: Tensor, t: Tensor | None) -> Tensor | None:
        """The adaLN input: the embedding of t, of time input 0 (``adaptive_norm``), or None."""
        if self.time_embed is None:
            return None
        if not self.config.time_conditioning:
            t = torch.zeros(z.shape[0], device=z.device)
        return self.time_embed(t)

    # ------------------------------------------------------------------- as a Denoiser
    def logits(self, z_t: Tensor, t: Tensor | None = None) -> Tensor:
        return self(z_t, t)

    def logits_at(self, z_t: Tensor, t: Tensor | None, selected: Tensor) -> Tensor:
        return self(z_t, t, output_mask=selected)

    def nll_at(self, z_t: Tensor, t: Tensor | None, selected: Tensor, targets: Tensor,
               chunk_rows: int | None = None) -> Tensor:
        return self(z_t, t, output_mask=selected, targets=targets, chunk_rows=chunk_rows)

    def given_clean(self, x0: Tensor, block_size: int) -> Denoiser:
        """Block diffusion's denoiser of z_t given the clean x0 (``model.block_diffusion.BlockDenoiser``)."""
        return CleanBlocksDenoiser(self, x0, block_size)

    @property
    def fused_nll(self) -> bool:
        return True

    @property
    def time_independent(self) -> bool:
        """Whether the output depends on z alone (no time conditioning): samplers may reuse it."""
        return not self.config.time_conditioning

    def output_logits(self, hidden: Tensor) -> Tensor:
        """Project final hidden states [..., d] to logits over the V clean tokens (with padded
        rows, a view of the first V columns of ``_padded_logits``)."""
        logits = self._padded_logits(hidden)
        return logits if self.logit_mask is None else logits[..., :self.config.vocab_size]

    def _padded_logits(self, hidden: Tensor) -> Tensor:
        """Logits [..., logit_columns]: the V true ones, then -inf (the mask's row of a tied head
        or of ``head_mask_row``, and the padding: never predicted, SUBS)."""
        columns = self.config.logit_columns
        weight = (self.embed.weight if self.head is None else self.head.weight)[:columns]
        bias = None if self.head is None or self.head.bias is None else self.head.bias[:columns]
        if self.logit_mask is not None:
            mask = self.logit_mask.to(weight.dtype)
            bias = mask if bias is None else bias + mask
        return F.linear(hidden, weight, bias)


def _selected_rows(output_mask: Tensor, z: Tensor) -> Tensor:
    """The flat indices [N] of the True positions of ``output_mask`` (bool [B, L]), row-major."""
    if output_mask.shape != z.shape:
        raise ValueError(f"output_mask has shape {tuple(output_mask.shape)}, expected {tuple(z.shape)}")
    return output_mask.flatten().nonzero().squeeze(1)


def _padded(module: nn.Embedding | nn.Linear, rows: int) -> nn.Embedding | nn.Linear:
    """``module`` (an embedding or the head) with zero rows appended up to ``rows``. Built at
    its true size first, so that it draws the random numbers an unpadded one draws: a seed
    then gives the same network, true rows and every other weight, whatever the padding."""
    extra = rows - module.weight.shape[0]
    if extra:
        module.weight = nn.Parameter(F.pad(module.weight.detach(), (0, 0, 0, extra)))
        if getattr(module, "bias", None) is not None:
            module.bias = nn.Parameter(F.pad(module.bias.detach(), (0, extra)))
        if isinstance(module, nn.Embedding):
            module.num_embeddings = rows
        else:
            module.out_features = rows
    return module


def _normal_rows(weight: Tensor, rows: int, std: float) -> None:
    """N(0, std^2) in the first ``rows`` rows (drawing what a weight of ``rows`` rows would),
    zeros in the padding after them."""
    with torch.no_grad():
        nn.init.normal_(weight[:rows], mean=0.0, std=std)
        weight[rows:].zero_()


def unpadded_state(state: dict[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
    """A state dict of a network of ``config`` without its padded rows: that of the same
    network with ``vocab_multiple = 1`` (what exports hold)."""
    rows = {"embed.weight": config.token_rows, "head.weight": config.head_rows, "head.bias": config.head_rows}
    return {name: tensor[:rows[name]] if name in rows else tensor for name, tensor in state.items()}


# --------------------------------------------------------------------------- counting
@dataclass(frozen=True)
class ParameterCounts:
    """Parameter counts; non-embedding excludes the token embedding, an untied head and a
    learned position table (``FamilyLayers.learned_positions``: a lookup, no FLOPs)."""

    total: int
    non_embedding: int


def parameter_counts(config: TransformerConfig) -> ParameterCounts:
    """Counts from the config alone (no allocation), padded vocabulary rows included (they are
    allocated: memory estimates count them; FLOPs per token use ``vocab_multiple = 1``)."""
    d, hidden = config.d_model, config.mlp_hidden
    family = config.family or FamilyLayers()
    norm = d * (1 + int(family.norm_bias and family.norm == "layernorm"))  # weight (and bias)
    qkv = (config.n_heads + 2 * config.kv_heads) * config.head_dim
    mlp_matrices = 3 if family.mlp == "swiglu" else 2
    per_block = d * qkv + d * d + mlp_matrices * d * hidden + 2 * norm  # qkv + out, the MLP, two norms
    per_block += qkv * int(family.qkv_bias) + d * int(family.out_bias)
    per_block += ((mlp_matrices - 1) * hidden + d) if config.mlp_bias else 0
    extra = norm  # final norm
    if config.modulated:
        c, f = config.time_embed_dim, config.time_frequencies or config.time_embed_dim
        per_block += c * 6 * d + 6 * d
        extra += (f * c + c) + (c * c + c) + c * 2 * d + 2 * d
    if config.head_bias:
        extra += config.padded_head_rows
    embedding = config.embedding_rows * d + (0 if config.tie_weights else config.padded_head_rows * d)
    embedding += family.learned_positions * d
    non_embedding = config.n_layers * per_block + extra
    return ParameterCounts(total=non_embedding + embedding, non_embedding=non_embedding)


def count_parameters(model: Transformer) -> ParameterCounts:
    """Counts of an instantiated model."""
    total = sum(p.numel() for p in model.parameters())
    embedding = sum(module.weight.numel() for module in (model.embed, model.head, model.positions)
                    if module is not None)
    return ParameterCounts(total=total, non_embedding=total - embedding)
