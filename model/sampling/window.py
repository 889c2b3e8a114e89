"""The network as semi-autoregressive generation calls it, with its two options that trade exactness
for speed or quality: the approximate prefix cache and unsupervised classifier-free guidance.

A window is [context ; block]: the text before the block (kept) and the block being generated.

- ``plan.prefix_cache = N`` (Fast-dLLM's prefix cache, dKV-Cache's delayed refresh): a
  bidirectional network's keys and values of the context depend on the block, which changes
  from call to call; they are recomputed by a full forward of the window at a row's first
  call in a block and every N calls after it, and in between reused, so those calls run the
  block's rows alone. An approximation, named in the plan; with N = 1 every call is the full
  forward, the uncached one bit for bit. Needs a ``Transformer``.
- ``plan.guidance = w`` (SMDM, LLaDA): each call runs the window twice, as it is (cond) and
  with the prompt's kept tokens masked (un), and returns cond + w (cond - un), LLaDA's
  un + (w + 1)(cond - un) written so that w = 0 is the conditional network exactly. Two
  passes: ``passes`` is what ``NetworkCalls`` counts per call.

Calls name their rows (``rows``, set by ``WindowCalls``): the cache and the prompt are per row,
so a row's output depends only on its own history. docs/fast-generation.md.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.block_attention import AttentionLayout, KVCache
from model.denoiser import Denoiser
from model.sampling.core import NetworkCalls
from model.sampling.plan import SamplingPlan

__all__ = ["PrefixKV", "WindowCalls", "WindowNetwork"]


class PrefixKV(KVCache):
    """The context's keys and values [B, heads, P, head_dim] per attention module, for every row of
    the batch. ``store`` True: a full forward of the window keeps its first ``context`` positions'
    (of the rows ``index``); False: the block's forward gets them prepended."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch, self.context, self.store = batch, 0, False
        self.index: Tensor | None = None   # LongTensor [R]: the batch rows of the current forward

    def extend(self, module: nn.Module, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``module``'s keys and values [R, heads, rows, head_dim] as its attention uses them: kept
        (``store``) and returned as they are, or the context's prepended."""
        name = id(module)
        if self.store:
            if name not in self.keys:
                shape = (self.batch, k.shape[1], self.context, k.shape[3])
                self.keys[name], self.values[name] = k.new_zeros(shape), v.new_zeros(shape)
            self.keys[name][self.index] = k[:, :, :self.context]
            self.values[name][self.index] = v[:, :, :self.context]
            return k, v
        return (torch.cat([self.keys[name][self.index], k], dim=2),
                torch.cat([self.values[name][self.index], v], dim=2))


class WindowNetwork(Denoiser):
    """A denoiser over windows [R, W] (module docstring); ``start`` before each window's sampling."""

    def __init__(self, network, plan: SamplingPlan, batch: int, mask_id: int) -> None:
        if plan.prefix_cache is not None and not isinstance(network, nn.Module):
            raise ValueError("prefix_cache reuses the keys and values of a Transformer's attention: the network "
                             f"must be one, got {type(network).__name__}")
        self.network, self.refresh, self.guidance, self.mask_id = network, plan.prefix_cache, plan.guidance, mask_id
        self.cache = PrefixKV(batch) if plan.prefix_cache is not None else None
        self.since = torch.zeros(batch, dtype=torch.long)   # calls since each row's last refresh
        self.rows: Tensor | None = None                     # bool [B]: the rows of the current call
        self.prompt: Tensor | None = None                   # bool [B, W]: the prompt's kept positions

    @property
    def passes(self) -> int:
        """Forward passes per call: two with guidance."""
        return 1 if self.guidance is None else 2

    @property
    def time_independent(self) -> bool:
        """The wrapped network's."""
        return self.network.time_independent

    def start(self, context: int, prompt: Tensor) -> None:
        """A new window: ``context`` kept positions before the block, ``prompt`` bool [B, W]."""
        self.prompt = prompt
        self.since.zero_()
        if self.cache is not None:
            self.cache.keys.clear(), self.cache.values.clear()
            self.cache.context = context

    def logits(self, z_t: Tensor, t: Tensor) -> Tensor:
        """Logits [R, W, V] of every position (guided); the prefix cache cannot give the context's."""
        if self.cache is not None and self.cache.context:
            raise ValueError("prefix_cache serves the samplers that ask for the masked positions only (the absorbing "
                             "process's); this one asks for every position")
        return self._guided(lambda z: self.network.logits(z, t), z_t)

    def logits_at(self, z_t: Tensor, t: Tensor, selected: Tensor) -> Tensor:
        """Logits [N, V] at the ``selected`` positions of the call's rows (guided, or from the cache)."""
        if self.cache is None or not self.cache.context:
            return self._guided(lambda z: self.network.logits_at(z, t, selected), z_t)
        return self._cached(z_t, t, selected)

    def _guided(self, forward, z: Tensor) -> Tensor:
        cond = forward(z)
        if self.guidance is None:
            return cond
        prompt = self.prompt if self.rows is None or z.shape[0] == self.prompt.shape[0] else self.prompt[self.rows]
        un = forward(torch.where(prompt, self.mask_id, z))
        return cond + self.guidance * (cond - un)

    def _cached(self, z: Tensor, t: Tensor, selected: Tensor) -> Tensor:
        """The call's logits [N, V], each row by a full (refreshing) forward or from its cached context."""
        rows = self.rows if self.rows is not None else torch.ones(z.shape[0], dtype=torch.bool, device=z.device)
        index = rows.nonzero().flatten()                       # [R] batch rows of z's rows
        if z.shape[0] == rows.shape[0]:                        # every row of the batch was passed
            z, selected = z[index], selected[index]
            t = None if t is None else t[index]
        context = self.cache.context
        if bool(selected[:, :context].any()):
            raise ValueError("prefix_cache: a position of the context was asked for; the context is kept text")
        refresh = (self.since[index.cpu()] % self.refresh == 0).to(z.device)   # [R]
        owner = selected.nonzero()[:, 0]                       # the row of each selected position, row-major
        out: Tensor | None = None
        for group, store in ((refresh, True), (~refresh, False)):
            if not bool(group.any()):
                continue
            self.cache.store, self.cache.index = store, index[group]
            window = z[group] if store else z[group][:, context:]                 # [G, W] or [G, L'] the block
            chosen = selected[group] if store else selected[group][:, context:]
            layout = AttentionLayout(None, None, self.cache)
            logits = self.network(window, None if t is None else t[group], output_mask=chosen, layout=layout)
            out = logits.new_empty((owner.shape[0], logits.shape[-1])) if out is None else out
            out[group[owner]] = logits
        self.since[index.cpu()] += 1
        return out


class WindowCalls(NetworkCalls):
    """``NetworkCalls`` that tell the window's network which rows a call passes and count its passes."""

    def _count(self, rows: Tensor, passed: int) -> None:
        for _ in range(self.denoiser.passes):
            super()._count(rows, passed)

    def logits_at(self, z: Tensor, t: Tensor, rows: Tensor, selected: Tensor) -> Tensor:
        """``NetworkCalls.logits_at``, the rows told to the window's network first."""
        self.denoiser.rows = rows.to(z.device)
        return super().logits_at(z, t, rows, selected)

    def logits(self, z: Tensor, t: Tensor, rows: Tensor) -> Tensor:
        """``NetworkCalls.logits``, the rows told to the window's network first."""
        self.denoiser.rows = rows.to(z.device)
        return super().logits(z, t, rows)
