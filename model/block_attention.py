"""Attention layouts of block diffusion (BD3-LM): which rows attend to which, and where they sit.

Training runs one forward over [z ; x], the noised sequence and the clean one (2L rows, both
at positions 0..L-1), in blocks of ``block_size`` (``_block_rule``), so the noisy half's output
at block b is exactly that of a forward of (x^<b, z^b) alone. The mask exists as a dense
boolean matrix [2L, 2L] for SDPA (CPU, and the fallback) and as FlexAttention's ``BlockMask``
on tiles of ``FLEX_TILE`` (GPU), entry for entry the same (tested). ``AttentionLayout`` carries
one of them, the rows' rotary positions and, when sampling, a ``KVCache`` of the finished
blocks. docs/block-diffusion.md, docs/math.md#block-diffusion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.denoiser import Denoiser

__all__ = ["FLEX_TILE", "AttentionLayout", "BlockAttention", "CleanBlocksDenoiser", "KVCache", "MaskMod",
           "block_causal_mask", "block_mask_mod", "dense_block_mask", "flex_block_mask", "flex_mask", "training_layout"]

# FlexAttention's tile (its default BLOCK_SIZE): the BlockMask records which 128 x 128 tiles are
# empty, full or partial, and evaluates the mask_mod inside the partial ones.
FLEX_TILE = 128
BlockAttention = Literal["dense", "flex"]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _block_rule(q_idx: Tensor, k_idx: Tensor, length: int, block_size: int) -> Tensor:
    """Whether query row ``q_idx`` attends key row ``k_idx``, for rows in [0, 2L): < L noisy, >= L clean.

        query in       key in         attends when
        noisy block b  noisy block c  c == b        (bidirectional inside the block)
        noisy block b  clean block c  c <  b        (the clean prefix)
        clean block b  noisy block c  never
        clean block b  clean block c  c <= b        (block-causal)
    """
    q_noisy, k_noisy = q_idx < length, k_idx < length
    q_block, k_block = (q_idx % length) // block_size, (k_idx % length) // block_size
    noisy_noisy = q_noisy & k_noisy & (q_block == k_block)
    noisy_clean = q_noisy & ~k_noisy & (k_block < q_block)
    clean_clean = ~q_noisy & ~k_noisy & (k_block <= q_block)
    return noisy_noisy | noisy_clean | clean_clean


def dense_block_mask(length: int, block_size: int, device: torch.device | str | None = None) -> Tensor:
    """The training mask over [z ; x], bool [2L, 2L], True where the query row attends the key row."""
    index = torch.arange(2 * length, device=device)
    return _block_rule(index[:, None], index[None, :], length, block_size)


def block_mask_mod(length: int, block_size: int) -> MaskMod:
    """The same rule as FlexAttention's ``mask_mod(batch, head, q_idx, k_idx)``."""
    def mask_mod(batch: Tensor, head: Tensor, q_idx: Tensor, k_idx: Tensor) -> Tensor:
        return _block_rule(q_idx, k_idx, length, block_size)
    return mask_mod


def flex_block_mask(length: int, block_size: int, device: torch.device | str):
    """FlexAttention's compiled ``BlockMask`` of the training mask (tiles of ``FLEX_TILE``)."""
    return flex_mask(block_mask_mod(length, block_size), 2 * length, device)


def flex_mask(mask_mod: MaskMod, rows: int, device: torch.device | str):
    """FlexAttention's compiled ``BlockMask`` of ``mask_mod`` over ``rows`` rows (tiles of ``FLEX_TILE``)."""
    from torch.nn.attention.flex_attention import create_block_mask  # only where FlexAttention runs

    return create_block_mask(mask_mod, None, None, rows, rows, device=device, BLOCK_SIZE=FLEX_TILE)


def block_causal_mask(length: int, block_size: int, device: torch.device | str | None = None) -> Tensor:
    """Block-causal attention over a clean prefix followed by one noisy block, bool [L, L]: the
    mask of the naive per-block forward of (x^<b, z^b) (the last block is the noisy one)."""
    block = torch.arange(length, device=device) // block_size
    return block[None, :] <= block[:, None]


_flex_attention = None


def _flex(q: Tensor, k: Tensor, v: Tensor, block_mask) -> Tensor:
    """FlexAttention, compiled on GPU once (uncompiled it materializes the scores; CPU tests only)."""
    global _flex_attention
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask)
    if _flex_attention is None:
        _flex_attention = torch.compile(flex_attention, dynamic=False)
    return _flex_attention(q, k, v, block_mask=block_mask)


@dataclass
class KVCache:
    """Keys and values of finished blocks, per attention module, [B, heads, P, head_dim] each.

    The keys are kept before the rotary rotation: a forward rotates the cached and new keys
    together at positions 0..P+rows-1 and its queries at the last positions, so after the
    window slides (``keep``) the positions still start at 0 and stay inside the rotary table
    (attention scores depend only on the distance between positions). ``extend`` returns the
    cached keys and values followed by the current rows' (of the cached rows ``rows``, bool
    [B]: a sampler passes only the rows that need the network); with ``append`` True it also
    keeps the current rows (a finished block's clean pass, every row). ``last`` is the last
    token of the cached text, [B]: a shifted network's first row of the next block (``model.shift``),
    set by its clean pass.
    """

    append: bool = False
    rows: Tensor | None = None
    keys: dict[int, Tensor] = field(default_factory=dict)
    values: dict[int, Tensor] = field(default_factory=dict)
    last: Tensor | None = None

    def last_of(self, batch: int) -> Tensor | None:
        """``last`` of the rows of a call of ``batch`` rows (``rows``' when it passes only some)."""
        if self.last is None or self.rows is None or self.last.shape[0] == batch:
            return self.last
        return self.last[self.rows]

    def extend(self, module: nn.Module, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        name = id(module)
        if name in self.keys:
            cached_k, cached_v = self.keys[name], self.values[name]
            if self.rows is not None and cached_k.shape[0] != k.shape[0]:
                cached_k, cached_v = cached_k[self.rows], cached_v[self.rows]
            k, v = torch.cat([cached_k, k], dim=2), torch.cat([cached_v, v], dim=2)
        if self.append:
            self.keys[name], self.values[name] = k, v
        return k, v

    @property
    def length(self) -> int:
        """Cached positions (0 when empty)."""
        return next(iter(self.keys.values())).shape[2] if self.keys else 0

    def keep(self, positions: int) -> None:
        """Keep only the last ``positions`` cached positions of every module."""
        for name in self.keys:
            self.keys[name] = self.keys[name][:, :, self.keys[name].shape[2] - positions:]
            self.values[name] = self.values[name][:, :, self.values[name].shape[2] - positions:]


@dataclass
class AttentionLayout:
    """How a forward's rows attend: their ``positions`` [rows] (None: 0..rows-1), ``mask``
    (bool [rows, keys] for SDPA, a FlexAttention ``BlockMask``, or None: the network's own
    full or causal attention), ``cache``, finished blocks' keys and values prepended, and
    ``outputs``, the rows whose outputs are the forward's, in order (None: the first L)."""

    positions: Tensor | None
    mask: object | None
    cache: KVCache | None = None
    outputs: Tensor | None = None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, dropout: float) -> Tensor:
        if isinstance(self.mask, Tensor):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=dropout)
        if dropout:
            raise ValueError("FlexAttention's block mask runs without attention dropout (model.dropout = 0)")
        return _flex(q, k, v, self.mask)


def training_layout(length: int, block_size: int, device: torch.device, kind: BlockAttention) -> AttentionLayout:
    """The layout of the vectorized training forward over [z ; x] (2L rows)."""
    if length % block_size:
        raise ValueError(f"block_size {block_size} must divide the sequence length {length}")
    positions = torch.arange(length, device=device).repeat(2)
    mask = flex_block_mask(length, block_size, device) if kind == "flex" else dense_block_mask(length, block_size,
                                                                                                device)
    return AttentionLayout(positions, mask)


class CleanBlocksDenoiser(Denoiser):
    """A network's block-diffusion forward closed over the clean sequence x0 [B, L]: each call
    is ``forward(z_t, None, ..., clean=x0, block_size=block_size)``, the vectorized forward over
    [z ; x]. ``forward`` is the network, or a wrapper that only sees calls (DeepSpeed's engine)."""

    def __init__(self, forward: Callable[..., Tensor], x0: Tensor, block_size: int) -> None:
        self.forward, self.x0, self.block_size = forward, x0, block_size

    def logits(self, z_t: Tensor, t: Tensor | None) -> Tensor:
        return self.forward(z_t, None, clean=self.x0, block_size=self.block_size)

    def logits_at(self, z_t: Tensor, t: Tensor | None, selected: Tensor) -> Tensor:
        return self.forward(z_t, None, output_mask=selected, clean=self.x0, block_size=self.block_size)

    def nll_at(self, z_t: Tensor, t: Tensor | None, selected: Tensor, targets: Tensor,
               chunk_rows: int | None = None) -> Tensor:
        return self.forward(z_t, None, output_mask=selected, targets=targets, chunk_rows=chunk_rows,
                            clean=self.x0, block_size=self.block_size)

    @property
    def fused_nll(self) -> bool:
        return True

    @property
    def time_independent(self) -> bool:
        return True
