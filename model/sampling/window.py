"""The network as semi-autoregressive generation calls it, with its options that trade exactness
for speed or quality: whole-sequence blocks, the approximate prefix and dual caches, and
unsupervised classifier-free guidance.

A window is [context ; block]: the text before the block (kept) and the block being generated.

- ``plan.whole_sequence`` (LLaDA, Fast-dLLM): the network sees the window followed by the rest
  of the sequence (``suffix``, still masked but for a prompt's kept tokens); the sampler still
  sees and reveals the window's block only, so every call answers for the block alone.
- ``plan.prefix_cache = N`` (Fast-dLLM's prefix cache, dKV-Cache's delayed refresh): a
  bidirectional network's keys and values of the context depend on the block, which changes
  from call to call; they are recomputed by a full forward at a row's first call in a block
  and every N calls after it, and in between reused, so those calls run the block's rows (and
  the suffix's) alone. ``plan.dual_cache = N`` (Fast-dLLM's DualCache) caches the suffix's too:
  between refreshes only the block's rows run. Approximations, named in the plan; with N = 1
  every call is the full forward, the uncached one bit for bit. They need a ``Transformer``.
- ``plan.guidance = w`` (SMDM, LLaDA): each call runs the window twice, as it is (cond) and
  with the prompt's kept tokens masked (un), and returns cond + w (cond - un), LLaDA's
  un + (w + 1)(cond - un) written so that w = 0 is the conditional network exactly. Two
  passes: ``passes`` is what ``NetworkCalls`` counts per call. With a cache, the unprompted pass
  keeps its own keys and values (``unprompted``), refreshed at the same calls.

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
    """The cached keys and values [B, heads, P, head_dim] per attention module, for every row of the
    batch: the first ``context`` positions of the full forward, or with ``dual`` all of them. ``store``
    True: a full forward keeps them (of the rows ``index``); False: a forward of the rows after the
    context gets them around its own (the context before, with ``dual`` the suffix after)."""

    def __init__(self, batch: int, dual: bool = False) -> None:
        super().__init__()
        self.batch, self.context, self.store, self.dual = batch, 0, False, dual
        self.index: Tensor | None = None   # LongTensor [R]: the batch rows of the current forward

    def extend(self, module: nn.Module, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``module``'s keys and values [R, heads, rows, head_dim] as its attention uses them: kept
        (``store``) and returned as they are, or the cached ones around them, in position order."""
        name = id(module)
        if self.store:
            kept = k.shape[2] if self.dual else self.context
            if name not in self.keys:
                shape = (self.batch, k.shape[1], kept, k.shape[3])
                self.keys[name], self.values[name] = k.new_zeros(shape), v.new_zeros(shape)
            self.keys[name][self.index] = k[:, :, :kept]
            self.values[name][self.index] = v[:, :, :kept]
            return k, v
        keys, values = self.keys[name][self.index], self.values[name][self.index]
        after = self.context + k.shape[2]   # the cached suffix's first position (none without ``dual``)
        return (torch.cat([keys[:, :, :self.context], k, keys[:, :, after:]], dim=2),
                torch.cat([values[:, :, :self.context], v, values[:, :, after:]], dim=2))


class WindowNetwork(Denoiser):
    """A denoiser over windows [R, W] (module docstring); ``start`` before each window's sampling."""

    def __init__(self, network, plan: SamplingPlan, batch: int, mask_id: int) -> None:
        name = "dual_cache" if plan.dual_cache is not None else "prefix_cache"
        self.refresh = plan.dual_cache if plan.dual_cache is not None else plan.prefix_cache
        if self.refresh is not None and not isinstance(network, nn.Module):
            raise ValueError(f"{name} reuses the keys and values of a Transformer's attention: the network "
                             f"must be one, got {type(network).__name__}")
        self.network, self.guidance, self.mask_id = network, plan.guidance, mask_id
        self.cache = PrefixKV(batch, dual=plan.dual_cache is not None) if self.refresh is not None else None
        # guidance's unprompted pass sees other keys and values: its own cache, refreshed with the first
        self.unprompted = (PrefixKV(batch, dual=plan.dual_cache is not None)
                           if self.refresh is not None and self.guidance is not None else None)
        self.since = torch.zeros(batch, dtype=torch.long)   # calls since each row's last refresh
        self.rows: Tensor | None = None                     # bool [B]: the rows of the current call
        self.prompt: Tensor | None = None                   # bool [B, W + S]: the prompt's kept positions
        self.suffix: Tensor | None = None                   # [B, S]: whole_sequence's tokens after the window

    @property
    def passes(self) -> int:
        """Forward passes per call: two with guidance."""
        return 1 if self.guidance is None else 2

    @property
    def time_independent(self) -> bool:
        """The wrapped network's."""
        return self.network.time_independent

    def start(self, context: int, prompt: Tensor, suffix: Tensor | None = None) -> None:
        """A new window: ``context`` kept positions before the block, ``suffix`` [B, S] the tokens
        the network sees after the window (None: none), ``prompt`` bool [B, W + S] the kept ones."""
        self.prompt, self.suffix = prompt, suffix
        self.since.zero_()
        for cache in (self.cache, self.unprompted):
            if cache is not None:
                cache.keys.clear(), cache.values.clear()
                cache.context = context

    def logits(self, z_t: Tensor, t: Tensor) -> Tensor:
        """Logits [R, W, V] of every position of the window (guided); the caches cannot give the context's."""
        if self._caching():
            raise ValueError("prefix_cache and dual_cache serve the samplers that ask for the masked positions only "
                             "(the absorbing process's); this one asks for every position")
        width = z_t.shape[1]
        return self._guided(lambda z, _: self.network.logits(z, t)[:, :width], self._whole(z_t))

    def logits_at(self, z_t: Tensor, t: Tensor, selected: Tensor) -> Tensor:
        """Logits [N, V] at the ``selected`` positions of the call's rows (guided, or from the cache)."""
        z, selected = self._whole(z_t), self._whole(selected, False)
        if not self._caching():
            return self._guided(lambda whole, _: self.network.logits_at(whole, t, selected), z)
        block = z_t.shape[1] - self.cache.context
        logits = self._guided(lambda whole, cache: self._cached(whole, t, selected, block, cache), z)
        self.since[self._index(z).cpu()] += 1
        return logits

    def _caching(self) -> bool:
        """Whether a cache holds positions outside the call's rows: a context, or a dual cache's suffix."""
        if self.cache is None:
            return False
        return bool(self.cache.context) or (self.cache.dual and self.suffix is not None and self.suffix.shape[1] > 0)

    def _of_rows(self, per_row: Tensor, z: Tensor) -> Tensor:
        """``per_row`` [B, ...] of the call's rows (z's)."""
        return per_row if self.rows is None or z.shape[0] == per_row.shape[0] else per_row[self.rows]

    def _whole(self, z: Tensor, fill: bool | None = None) -> Tensor:
        """[R, W] -> [R, W + S]: the window, then the suffix's tokens (or ``fill``: a selection's False)."""
        if self.suffix is None:
            return z
        suffix = self._of_rows(self.suffix, z)
        suffix = suffix if fill is None else torch.full_like(suffix, fill, dtype=z.dtype)
        return torch.cat([z, suffix], dim=1)

    def _guided(self, forward, z: Tensor) -> Tensor:
        """``forward(z, cache)``, and with guidance the extrapolation from its unprompted pass's."""
        cond = forward(z, self.cache)
        if self.guidance is None:
            return cond
        un = forward(torch.where(self._of_rows(self.prompt, z), self.mask_id, z), self.unprompted)
        return cond + self.guidance * (cond - un)

    def _index(self, z: Tensor) -> Tensor:
        """LongTensor [R]: the batch rows of the call's rows."""
        rows = self.rows if self.rows is not None else torch.ones(z.shape[0], dtype=torch.bool, device=z.device)
        return rows.nonzero().flatten()

    def _cached(self, z: Tensor, t: Tensor, selected: Tensor, block: int, cache: PrefixKV) -> Tensor:
        """The call's logits [N, V], each row by a full (refreshing) forward or from its keys and values
        in ``cache``: the block's ``block`` rows alone (dual cache), or with the suffix's (prefix cache)."""
        index = self._index(z)                                 # [R] batch rows of z's rows
        if z.shape[0] == self.since.shape[0]:                  # every row of the batch was passed
            z, selected = z[index], selected[index]
            t = None if t is None else t[index]
        context = cache.context
        stop = context + block if cache.dual else z.shape[1]   # the rows run between refreshes
        if bool(selected[:, :context].any()) or bool(selected[:, stop:].any()):
            raise ValueError("prefix_cache, dual_cache: a cached position was asked for; only the block's are "
                             "generated")
        refresh = (self.since[index.cpu()] % self.refresh == 0).to(z.device)   # [R]
        owner = selected.nonzero()[:, 0]                       # the row of each selected position, row-major
        out: Tensor | None = None
        for group, store in ((refresh, True), (~refresh, False)):
            if not bool(group.any()):
                continue
            cache.store, cache.index = store, index[group]
            first, last = (0, z.shape[1]) if store else (context, stop)
            window, chosen = z[group][:, first:last], selected[group][:, first:last]   # [G, last - first]
            layout = AttentionLayout(torch.arange(first, last, device=z.device), None, cache)
            logits = self.network(window, None if t is None else t[group], output_mask=chosen, layout=layout)
            out = logits.new_empty((owner.shape[0], logits.shape[-1])) if out is None else out
            out[group[owner]] = logits
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
