"""Document masking: attention restricted to each packed document, positions restarting per document.

Prep packs documents back to back, each ended by the EOS id, the network's
``document_separator``. The documents are read from the tokens the network is given: a
separator ends its document and the next token starts one at position 0. A masked separator
splits nothing, so the segmentation, and with it the network, stays a function of z_t alone:
every bound still bounds -log p(x) (boundaries read from x0 would tell the network where the
masked EOS are, and score them for free). A document is named by the row where it starts
(``document_starts``); rows attend each other when they name the same one and the layout's
own rule (causal, block diffusion's) allows it. Block diffusion's noisy block b reads its
documents from the clean prefix x^<b and its own visible separators (``block_document_starts``).
The dense mask (SDPA) and FlexAttention's mask_mod evaluate the same rule (tested).
docs/training.md#document-masking.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.block_attention import FLEX_TILE, AttentionLayout, BlockAttention, MaskMod, block_mask_mod

__all__ = ["block_document_starts", "causal_mask_mod", "dense_document_mask", "document_layout",
           "document_mask_mod", "document_starts", "flex_document_mask", "masks_documents",
           "restrict_to_documents", "training_document_layout"]


def document_starts(tokens: Tensor, separator: int) -> Tensor:
    """The row where each position's document starts, LongTensor [B, L]: one past the last
    separator strictly before it (0 when none)."""
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    after_separator = torch.zeros_like(tokens, dtype=torch.bool)
    after_separator[:, 1:] = tokens[:, :-1] == separator
    return torch.where(after_separator, index, 0).cummax(dim=1).values


def block_document_starts(z: Tensor, clean: Tensor, separator: int, block_size: int) -> Tensor:
    """Document starts of block diffusion's rows [z ; x] (LongTensor [B, 2L], positions in the
    sequence, 0..L-1 in both halves, so equal starts are one document). A clean row reads
    x; a noisy row of block b reads x before the block and z's visible separators inside it,
    as the naive forward of (x^<b, z^b) does (``model.block_attention``)."""
    clean_starts, noisy_starts = document_starts(clean, separator), document_starts(z, separator)
    block_start = torch.arange(z.shape[1], device=z.device) // block_size * block_size  # [L]
    # A separator of z inside the block started the row's document there; otherwise the
    # document that was open at the block's first row goes on.
    inside = noisy_starts > block_start
    noisy = torch.where(inside, noisy_starts, clean_starts[:, block_start])
    return torch.cat([noisy, clean_starts], dim=1)  # [B, L] + [B, L] -> [B, 2L]


def causal_mask_mod(batch: Tensor, head: Tensor, q_idx: Tensor, k_idx: Tensor) -> Tensor:
    """The causal rule as a mask_mod: a query attends the keys at or before it."""
    return q_idx >= k_idx


def document_mask_mod(starts: Tensor, rule: MaskMod | None = None) -> MaskMod:
    """FlexAttention's ``mask_mod``: the query and key rows start the same document
    (``starts`` [B, rows]) and ``rule`` (None: full attention) allows the pair."""
    def mask_mod(batch: Tensor, head: Tensor, q_idx: Tensor, k_idx: Tensor) -> Tensor:
        same = starts[batch, q_idx] == starts[batch, k_idx]
        return same if rule is None else same & rule(batch, head, q_idx, k_idx)
    return mask_mod


def dense_document_mask(starts: Tensor, rule: MaskMod | None = None) -> Tensor:
    """The same rule as a boolean SDPA mask [B, 1, rows, rows] (broadcast over the heads)."""
    batch, rows = starts.shape
    index = torch.arange(rows, device=starts.device)
    batch_index = torch.arange(batch, device=starts.device)[:, None, None, None]
    return document_mask_mod(starts, rule)(batch_index, None, index[None, None, :, None], index[None, None, None, :])


def flex_document_mask(starts: Tensor, rule: MaskMod | None = None):
    """FlexAttention's ``BlockMask`` of the rule, per sequence (tiles of ``FLEX_TILE``)."""
    from torch.nn.attention.flex_attention import create_block_mask  # only where FlexAttention runs

    batch, rows = starts.shape
    return create_block_mask(document_mask_mod(starts, rule), batch, None, rows, rows, device=starts.device,
                             BLOCK_SIZE=FLEX_TILE)


def document_layout(starts: Tensor, kind: BlockAttention, rule: MaskMod | None = None,
                    index: Tensor | None = None) -> AttentionLayout:
    """Rows attending within their documents under ``rule``, at positions restarting at each
    document's first row (``starts`` [B, rows]; ``index`` [rows]: each row's place in the
    sequence, None: 0..rows-1); the mask dense or FlexAttention's."""
    index = torch.arange(starts.shape[1], device=starts.device) if index is None else index
    positions = index - starts  # [B, rows]
    mask = flex_document_mask(starts, rule) if kind == "flex" else dense_document_mask(starts, rule)
    return AttentionLayout(positions, mask)


def training_document_layout(z: Tensor, clean: Tensor | None, separator: int, kind: BlockAttention, *,
                             causal: bool = False, block_size: int | None = None) -> AttentionLayout:
    """The layout of a training or scoring forward over z [B, L] (with ``clean``: block
    diffusion's [z ; x], 2L rows): documents of the rows, the causal or block rule on top."""
    if clean is not None:
        index = torch.arange(z.shape[1], device=z.device).repeat(2)  # both halves sit at 0..L-1
        return document_layout(block_document_starts(z, clean, separator, block_size), kind,
                               block_mask_mod(z.shape[1], block_size), index)
    return document_layout(document_starts(z, separator), kind, causal_mask_mod if causal else None)


def restrict_to_documents(layout: AttentionLayout, tokens: Tensor, separator: int) -> AttentionLayout:
    """A caller's layout over ``tokens`` [B, rows] (the block sampler's block-causal mask over a
    clean prefix and a noisy block, without a KV cache) restricted to the documents of the rows."""
    if layout.cache is not None or layout.positions is not None:
        raise ValueError("document masking (network.document_separator) reads the documents of the rows it is "
                         "given: it cannot apply to a KV cache or to given positions; sample without the cache")
    starts = document_starts(tokens, separator)
    same = dense_document_mask(starts)
    mask = same if layout.mask is None else same & layout.mask
    return AttentionLayout(torch.arange(tokens.shape[1], device=tokens.device) - starts, mask)


def masks_documents(network: object) -> bool:
    """Whether ``network`` (a ``Transformer``, or anything with its ``config``) masks documents."""
    return getattr(getattr(network, "config", None), "document_separator", None) is not None
