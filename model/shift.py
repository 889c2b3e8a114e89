"""The shift of an adapted autoregressive model: each token is predicted at the row before it.

An autoregressive network's output at a row predicts the next token. A network adapted from
one (``TransformerConfig.shift``) keeps that alignment, so its pretrained head goes on
predicting what it was trained to: row i reads the token before i and predicts x_i, and a
start row (id V + 1, the source's start token's embedding) comes first. What a caller relies
on: every token is scored, and every token of z_t is read.

    MDLM, z [B, L]:  rows [s, z_0, ..., z_{L-1}] at positions 0..L; row i predicts x_i, the
                     last row is read by the others and predicts nothing (L + 1 positions).
    block diffusion, [z ; x] in blocks of L':  per block b a group [x_{bL'-1}, z^b] (the
                     clean token before the block, s for the first) at positions bL'..(b+1)L',
                     then the clean rows [s, x_0, ..., x_{L-2}] at 0..L-1; a group sees itself
                     and the clean rows of blocks < b, a clean row those of blocks <= its own.

So block b's predictions see z^b whole and the clean tokens before it, as BD3-LM's do; with
L' = 1 and attention causal by position it is the autoregressive model itself. The block
sampler's window is the group (a KV cache of the clean rows before it; ``KVCache.last`` holds
x_{bL'-1}). docs/adapting.md#the-shift, docs/math.md#the-shift.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.block_attention import AttentionLayout, BlockAttention, MaskMod, flex_mask

__all__ = ["dense_shifted_mask", "shifted_input", "shifted_mask_mod", "shifted_training_layout",
           "shifted_training_rows"]


def shifted_input(z: Tensor, lead: Tensor | int) -> Tensor:
    """[lead, z_0, ..., z_{L-1}], [B, L + 1], of z [B, L]; ``lead`` an id or one per row ([B])."""
    first = z.new_full((z.shape[0], 1), lead) if isinstance(lead, int) else lead.to(z)[:, None]
    return torch.cat([first, z], dim=1)


def shifted_training_rows(z: Tensor, clean: Tensor, block_size: int, start_id: int) -> Tensor:
    """The ids [B, L + L / L' + L] of block diffusion's shifted forward over z and x (module
    docstring): the groups [x_{bL'-1}, z^b], then the clean rows [s, x_0, ..., x_{L-2}]."""
    batch = z.shape[0]
    clean_rows = shifted_input(clean[:, :-1], start_id)                      # [B, L]
    leads = clean_rows[:, ::block_size, None]                                # [B, blocks, 1]: x_{bL'-1}, s first
    groups = torch.cat([leads, z.view(batch, -1, block_size)], dim=2)        # [B, blocks, L' + 1]
    return torch.cat([groups.flatten(1), clean_rows], dim=1)                 # [B, blocks (L' + 1) + L]


def _shifted_rule(q_idx: Tensor, k_idx: Tensor, length: int, block_size: int) -> Tensor:
    """Whether query row ``q_idx`` attends key row ``k_idx`` of ``shifted_training_rows``:

        query in       key in         attends when
        group b        group c        c == b        (the group, bidirectional)
        group b        clean block c  c <  b        (the clean prefix)
        clean block b  group c        never
        clean block b  clean block c  c <= b        (block-causal)
    """
    group_rows = block_size + 1
    noisy_rows = length // block_size * group_rows
    q_noisy, k_noisy = q_idx < noisy_rows, k_idx < noisy_rows
    q_block = torch.where(q_noisy, q_idx // group_rows, (q_idx - noisy_rows) // block_size)
    k_block = torch.where(k_noisy, k_idx // group_rows, (k_idx - noisy_rows) // block_size)
    groups = q_noisy & k_noisy & (q_block == k_block)
    prefix = q_noisy & ~k_noisy & (k_block < q_block)
    clean = ~q_noisy & ~k_noisy & (k_block <= q_block)
    return groups | prefix | clean


def _rows(length: int, block_size: int) -> int:
    return length // block_size * (block_size + 1) + length


def dense_shifted_mask(length: int, block_size: int, device: torch.device | str | None = None) -> Tensor:
    """The shifted training mask, bool [rows, rows] (rows = L + L / L' + L)."""
    index = torch.arange(_rows(length, block_size), device=device)
    return _shifted_rule(index[:, None], index[None, :], length, block_size)


def shifted_mask_mod(length: int, block_size: int) -> MaskMod:
    """The same rule as FlexAttention's ``mask_mod(batch, head, q_idx, k_idx)``."""
    def mask_mod(batch: Tensor, head: Tensor, q_idx: Tensor, k_idx: Tensor) -> Tensor:
        return _shifted_rule(q_idx, k_idx, length, block_size)
    return mask_mod


def shifted_training_layout(length: int, block_size: int, device: torch.device, kind: BlockAttention
                            ) -> AttentionLayout:
    """The layout of block diffusion's shifted training forward: the rows' positions, the mask
    (dense or FlexAttention's) and the rows whose outputs predict x_0, ..., x_{L-1}."""
    if length % block_size:
        raise ValueError(f"block_size {block_size} must divide the sequence length {length}")
    blocks = length // block_size
    group = torch.arange(blocks, device=device)[:, None] * block_size                  # [blocks, 1]
    group_positions = (group + torch.arange(block_size + 1, device=device)[None]).flatten()  # [blocks (L' + 1)]
    positions = torch.cat([group_positions, torch.arange(length, device=device)])
    outputs = (torch.arange(blocks, device=device)[:, None] * (block_size + 1)
               + torch.arange(block_size, device=device)[None]).flatten()               # [L]: all but each group's last
    mask = (flex_mask(shifted_mask_mod(length, block_size), _rows(length, block_size), device) if kind == "flex"
            else dense_shifted_mask(length, block_size, device))
    return AttentionLayout(positions, mask, outputs=outputs)
