"""Block diffusion's sampler: block by block, any absorbing sampler inside a block, finished blocks cached.

Block b is sampled as a sequence of L' tokens whose network sees the finished blocks before
it; the finished block then runs once through the network, clean, and its keys and values join
the cache (``model.block_attention.KVCache``), so a call costs the block's L' rows.
``cache=False`` recomputes the window at every call: the same samples while the text fits in
it. Past ``window`` the cache slides by whole blocks, and ``plan.until_eos`` finishes a sample
after the block in which it generates that token. A sample depends only on its own generator.
docs/block-diffusion.md#sample.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from model.block_attention import AttentionLayout, KVCache, block_causal_mask
from model.checks import check_positive_int
from model.denoiser import Denoiser
from model.generators import Generators
from model.sampling.core import NetworkCalls, SamplingStats, sample_generators
from model.sampling.draw import Sampler, initial_tokens
from model.sampling.plan import SamplingPlan

__all__ = ["BlockNetwork", "draw_blocks"]


class BlockNetwork(Denoiser):
    """The network as a block's denoiser: z [R, L'] (R of the batch's rows) -> logits [R, L', V],
    seeing the finished blocks through the KV cache, or recomputing them (``cache`` None)."""

    def __init__(self, network, block_size: int) -> None:
        self.network, self.block_size = network, block_size
        self.cache: KVCache | None = None
        self.prefix: Tensor | None = None  # [B, P] finished tokens in the window (recomputed without a cache)
        self.rows: Tensor | None = None    # bool [B]: the rows of the current call (None: all)

    def logits(self, z_t: Tensor, t: Tensor | None) -> Tensor:
        return self._forward(z_t, None)

    def logits_at(self, z_t: Tensor, t: Tensor | None, selected: Tensor) -> Tensor:
        return self._forward(z_t, selected)

    @property
    def time_independent(self) -> bool:
        return True

    def _rows(self, z: Tensor) -> Tensor | None:
        batch = self.prefix.shape[0] if self.prefix is not None else None
        return None if self.rows is None or z.shape[0] == batch else self.rows

    def _forward(self, z: Tensor, selected: Tensor | None) -> Tensor:
        rows = self._rows(z)
        if self.cache is not None:
            self.cache.rows = rows
            return self.network(z, None, output_mask=selected, layout=AttentionLayout(None, None, self.cache))
        prefix = self.prefix if rows is None else self.prefix[rows]
        sequence = torch.cat([prefix, z], dim=1)  # [R, P] + [R, L'] -> [R, P + L']
        if getattr(getattr(self.network, "config", None), "shift", False):
            return self._shifted_forward(sequence, prefix.shape[1], selected)
        layout = AttentionLayout(None, block_causal_mask(sequence.shape[1], self.block_size, z.device))
        if selected is not None:
            selected = torch.cat([torch.zeros_like(prefix, dtype=torch.bool), selected], dim=1)
            return self.network(sequence, None, output_mask=selected, layout=layout)
        return self.network(sequence, None, layout=layout)[:, prefix.shape[1]:]

    def _shifted_forward(self, sequence: Tensor, prefix: int, selected: Tensor | None) -> Tensor:
        """A shifted network (``model.shift``) builds its own rows: its training forward over
        [prefix ; z], whose last block's outputs see that block's z and the clean prefix only."""
        if selected is None:
            return self.network(sequence, None, clean=sequence, block_size=self.block_size)[:, prefix:]
        selected = torch.cat([selected.new_zeros(selected.shape[0], prefix), selected], dim=1)
        return self.network(sequence, None, output_mask=selected, clean=sequence, block_size=self.block_size)

    def append(self, block: Tensor, context: int | None) -> None:
        """Run the finished block [B, L'] once, clean, keeping its keys and values; then keep
        at most ``context`` cached positions (None: all)."""
        self.cache.append, self.cache.rows = True, None
        try:
            nothing = torch.zeros_like(block, dtype=torch.bool)  # no logits wanted: skip the head
            self.network(block, None, output_mask=nothing, layout=AttentionLayout(None, None, self.cache))
        finally:
            self.cache.append = False
        if context is not None and self.cache.length > context:
            self.cache.keep(context)


class _RowCalls(NetworkCalls):
    """``NetworkCalls`` that tell the block's denoiser which rows a call passes (the cache is per row)."""

    def logits_at(self, z: Tensor, t: Tensor, rows: Tensor, selected: Tensor) -> Tensor:
        self.denoiser.rows = rows.to(z.device)   # indexes the cached keys and values, on the network's device
        return super().logits_at(z, t, rows, selected)

    def logits(self, z: Tensor, t: Tensor, rows: Tensor) -> Tensor:
        self.denoiser.rows = rows.to(z.device)
        return super().logits(z, t, rows)


def _context(window: int | None, block_size: int) -> int | None:
    """Finished positions the network sees before a block: whole blocks of ``window - L'``."""
    if window is None:
        return None
    check_positive_int("window", window)
    if window < block_size:
        raise ValueError(f"the network's window of {window} positions is shorter than a block of {block_size}")
    return (window - block_size) // block_size * block_size


def _refuse_window_options(plan: SamplingPlan) -> None:
    """The options of ``model.sampling.window``, which a block diffusion model does not take."""
    reasons = {"prefix_cache": "its finished blocks are cached exactly already",
               "dual_cache": "its finished blocks are cached exactly already, and its blocks never see the suffix",
               "whole_sequence": "its blocks attend to the finished ones only, as it was trained",
               "guidance": "the prompt sits in the KV cache of the finished blocks, which a second, unprompted pass "
                           "would need again"}
    for name, why in reasons.items():
        if getattr(plan, name) is not None and getattr(plan, name) is not False:
            raise ValueError(f"{name}: a block diffusion model does not take it: {why}")


@torch.no_grad()
def draw_blocks(process, sampler: Sampler, network, plan: SamplingPlan, *, num_samples: int, seq_len: int,
                prompt: Tensor | None = None, generator: Generators = None, window: int | None = None,
                device: torch.device | str | None = None, cache: bool = True,
                on_block: Callable[[], None] | None = None) -> tuple[Tensor, SamplingStats]:
    """Sample ``num_samples`` sequences of ``seq_len`` tokens (any: a last partial block is
    sampled whole and cut) block by block (module docstring). ``process``: a ``BlockDiffusion``; ``network``:
    a ``Transformer`` (its forward takes a ``layout``); the rest as ``model.sampling.draw``.
    ``cache`` False recomputes the finished blocks at every call. ``on_block`` is called after
    each block (a caller's progress within a long sample)."""
    block_size = process.block_size
    check_positive_int("num_samples", num_samples)
    check_positive_int("seq_len", seq_len)
    if plan.block_len is not None and plan.block_len != block_size:
        raise ValueError(f"block_len {plan.block_len}: a block diffusion model samples in its own blocks of "
                         f"{block_size} tokens")
    _refuse_window_options(plan)
    context = _context(window, block_size)
    z = initial_tokens(process, num_samples, seq_len, prompt, device)
    # A last partial block is sampled whole and cut: dropping its last positions marginalizes them.
    z = torch.cat([z, z.new_full((num_samples, -seq_len % block_size), process.generate_id)], dim=1)
    generator = sample_generators(plan.seed, range(num_samples)) if generator is None else generator
    block_network = BlockNetwork(network, block_size)
    block_network.cache = KVCache() if cache else None
    calls = _RowCalls(block_network, num_samples, process.vocab_size, static_shape=plan.static_shape)
    finished = torch.zeros(num_samples, dtype=torch.bool, device=z.device)
    for start in range(0, z.shape[1], block_size):
        end = start + block_size
        first = 0 if context is None else max(0, start - context)
        block_network.prefix = z[:, first:start]
        generated = z[:, start:end] == process.generate_id            # [B, L']
        if plan.until_eos is not None:  # finished samples draw nothing more
            z[:, start:end][finished[:, None] & generated] = plan.until_eos
            generated &= ~finished[:, None]
        if bool(generated.any()):
            z[:, start:end] = sampler(process, plan, z[:, start:end].clone(), generator, calls)
        if on_block is not None:
            on_block()
        if plan.until_eos is not None:
            finished |= (generated & (z[:, start:end] == plan.until_eos)).any(1)
            if bool(finished.all()):
                z[:, end:][z[:, end:] == process.generate_id] = plan.until_eos
                break
        if cache and end < z.shape[1]:
            block_network.append(z[:, start:end], context)
    return z[:, :seq_len], calls.stats(plan.steps)

