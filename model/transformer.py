"""The denoiser network: a pre-norm transformer with rotary embeddings, a pure nn.Module built from its config.

Bidirectional by default; with ``causal=True`` the same code is the autoregressive baseline
(``model.autoregressive``). Optional time conditioning by adaLN-zero, as in the DiT of SEDD and
MDLM. Input ids range over V + 1 values (the V clean tokens and the mask id V, the causal
model's start token); the logits over the V clean tokens only, so the mask is never predicted
(SUBS). Norms, rotary embeddings and the time embedding run in float32. The options for exact
imports of MDLM's and BD3-LM's DiT and the vocabulary padding (``vocab_multiple``) leave
unmask's own network unchanged at their defaults: docs/model-api.md#modeltransformer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.block_attention import AttentionLayout, BlockAttention, CleanBlocksDenoiser, training_layout
from model.cross_entropy import CompiledCrossEntropy, chunked_cross_entropy
from model.denoiser import Denoiser
from model.documents import restrict_to_documents, training_document_layout

__all__ = ["TransformerConfig", "Transformer", "ParameterCounts", "PRESETS", "preset",
           "parameter_counts", "count_parameters", "TimeInput", "RopeAngles", "LOGLINEAR_SIGMA_EPS",
           "ROW_MULTIPLE", "round_up", "unpadded_state"]

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

    def __post_init__(self) -> None:
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
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"TransformerConfig: d_model={self.d_model} must split into n_heads="
                             f"{self.n_heads} heads of even size (rotary embeddings rotate pairs)")
        if self.time_conditioning and self.causal:
            raise ValueError("TransformerConfig: the causal baseline takes no time conditioning")
        if self.tie_weights and (self.head_bias or self.head_mask_row):
            raise ValueError("TransformerConfig: head_bias and head_mask_row need an untied head (tie_weights=False)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

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
        """Rows of the embedding: the V tokens and the mask, padded to ``vocab_multiple``."""
        return round_up(self.vocab_size + 1, self.vocab_multiple)

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
    """LayerNorm with a weight and no bias, computed in float32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), None, self.eps).type_as(x)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), rotating pairs (i, i + head_dim/2) of each head."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float, angles_dtype: RopeAngles = "float64") -> None:
        super().__init__()
        if angles_dtype == "float32":  # MDLM's rounding, step by step
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
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_heads, self.causal, self.dropout = config.n_heads, config.causal, config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_base, config.rope_angles)

    def forward(self, x: Tensor, layout: AttentionLayout | None = None) -> Tensor:
        batch, length, width = x.shape
        # [B, L, 3 d] -> [3, B, heads, L, head_dim]
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        if layout is not None and layout.cache is not None:
            # Finished blocks' keys and values first, kept before the rotation: the window's
            # positions start at 0 wherever it slid to (model.block_attention.KVCache).
            k, v = layout.cache.extend(self, k, v)
            key_positions = torch.arange(k.shape[2], device=k.device)
            q, k = self.rotary(q, key_positions[k.shape[2] - length:]), self.rotary(k, key_positions)
        else:
            positions = None if layout is None else layout.positions
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        dropout = self.dropout if self.training else 0.0
        if layout is None or layout.mask is None:
            # SDPA dispatches to flash / memory-efficient kernels on GPU. A block after its cache
            # attends to all of it and to itself: no mask.
            causal = self.causal and (layout is None or layout.cache is None)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout)
        else:
            y = layout.attend(q, k, v, dropout)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))  # [B, heads, L, hd] -> [B, L, d]


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.up = nn.Linear(config.d_model, hidden, bias=config.mlp_bias)
        self.down = nn.Linear(hidden, config.d_model, bias=config.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm block; with time conditioning, adaLN-zero modulation of both sub-layers."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = LayerNorm(config.d_model, config.norm_eps)
        self.attn = SelfAttention(config)
        self.mlp_norm = LayerNorm(config.d_model, config.norm_eps)
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
    ``model.documents``) and ``layout`` (the block sampler's positions, mask and KV cache).
    With ``config.document_separator`` every forward attends within the documents of its rows.
    All go through ``forward`` so that wrappers that only see calls (DeepSpeed's engine and ZeRO-3, torch.compile) see them. As a ``Denoiser``,
    ``logits``, ``logits_at`` and ``nll_at`` are these calls; it is ``time_independent`` without
    time conditioning. ``compile_parts`` compiles each block and the head with its loss.
    """

    def __init__(self, config: TransformerConfig, block_attention: BlockAttention = "dense") -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.embed = _padded(nn.Embedding(config.vocab_size + 1, d), config.embedding_rows)
        self.time_embed = (TimeEmbedding(config.time_embed_dim, config.time_frequencies or config.time_embed_dim,
                                         config.time_input) if config.modulated else None)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.final_norm = LayerNorm(d, config.norm_eps)
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
                _normal_rows(module.weight, self.config.vocab_size + 1, std)
            elif isinstance(module, LayerNorm):
                nn.init.ones_(module.weight)
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
                block_size: int | None = None, layout: AttentionLayout | None = None) -> Tensor:
        """Logits [B, L, V] of ``z`` [B, L] at times ``t`` [B]; with ``output_mask`` (bool [B, L]) the
        logits [N, V] at its True positions only; with ``targets`` [N] too, -log p of them there
        instead (float32, ``chunk_rows`` rows of the head at a time)."""
        if self.config.time_conditioning and t is None:
            raise ValueError("this Transformer is time-conditioned: pass t")
        selected = None if output_mask is None else _selected_rows(output_mask, z)
        cond = self._condition(z, t)
        length = z.shape[1]
        if clean is not None:  # block diffusion's training forward over [z ; x] (model.block_attention)
            layout = self._training_layout(z, clean, block_size)
        if self.config.document_separator is not None:  # attention inside each document (model.documents)
            layout = self._document_layout(z, clean, block_size, layout)
        if clean is not None:
            z = torch.cat([z, clean], dim=1)  # [B, L] + [B, L] -> [B, 2L]
        x = self.embed(z)
        for block in self.blocks:
            x = block(x, cond, layout)
        x = x[:, :length]  # the noisy half (all rows without a clean copy)
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

    def _training_layout(self, z: Tensor, clean: Tensor, block_size: int | None) -> AttentionLayout:
        if clean.shape != z.shape or block_size is None:
            raise ValueError(f"clean must have z's shape {tuple(z.shape)} (got {tuple(clean.shape)}) and come "
                             "with a block_size")
        if self.config.time_conditioning or self.config.causal:
            raise ValueError("block diffusion runs a bidirectional network without time conditioning")
        key = (z.shape[1], block_size, z.device, self.block_attention)
        if key not in self._layouts:
            self._layouts[key] = training_layout(z.shape[1], block_size, z.device, self.block_attention)
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
    rows = {"embed.weight": config.vocab_size + 1, "head.weight": config.head_rows, "head.bias": config.head_rows}
    return {name: tensor[:rows[name]] if name in rows else tensor for name, tensor in state.items()}


# --------------------------------------------------------------------------- counting
@dataclass(frozen=True)
class ParameterCounts:
    """Parameter counts; non-embedding excludes the token embedding and an untied head."""

    total: int
    non_embedding: int


def parameter_counts(config: TransformerConfig) -> ParameterCounts:
    """Counts from the config alone (no allocation), padded vocabulary rows included (they are
    allocated: memory estimates count them; FLOPs per token use ``vocab_multiple = 1``)."""
    d = config.d_model
    hidden = config.mlp_ratio * d
    per_block = 4 * d * d + 2 * d * hidden + 2 * d  # qkv + out, up + down, two norms
    per_block += (hidden + d) if config.mlp_bias else 0
    extra = d  # final norm
    if config.modulated:
        c, f = config.time_embed_dim, config.time_frequencies or config.time_embed_dim
        per_block += c * 6 * d + 6 * d
        extra += (f * c + c) + (c * c + c) + c * 2 * d + 2 * d
    if config.head_bias:
        extra += config.padded_head_rows
    embedding = config.embedding_rows * d + (0 if config.tie_weights else config.padded_head_rows * d)
    non_embedding = config.n_layers * per_block + extra
    return ParameterCounts(total=non_embedding + embedding, non_embedding=non_embedding)


def count_parameters(model: Transformer) -> ParameterCounts:
    """Counts of an instantiated model."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.embed.weight.numel() + (model.head.weight.numel() if model.head is not None else 0)
    return ParameterCounts(total=total, non_embedding=total - embedding)
