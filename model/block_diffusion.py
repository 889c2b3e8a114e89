"""Block diffusion (BD3-LM): autoregressive over blocks of L' tokens, absorbing diffusion inside each.

``BlockDiffusion`` is ``AbsorbingDiffusion`` with one time per block and a denoiser that sees
the clean blocks before the one it predicts (``BlockDenoiser.given_clean``); its bound is the
sum over blocks of each block's NELBO, with the same endpoint terms
(docs/math.md#block-diffusion). Times are [B, blocks], or [B]: row i's blocks then get
``(t_i + b / blocks) mod 1`` (``spread_over_blocks``), so one block of L is MDLM's estimate
draw for draw. The masks are drawn as the absorbing process draws them. Training's clipping
of the masking rates lives with the objective (``pipeline.training.objective``); every bound
here is the full one. The manual: docs/block-diffusion.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from model.absorbing import AbsorbingDiffusion
from model.checks import check_reconstruction
from model.denoiser import Denoiser, DenoiserLike, as_denoiser
from model.generators import Generators, batch_generator, uniforms
from model.process import NelboTerms, Reconstruction, low_discrepancy_times
from model.sampling import SamplingPlan, SamplingStats
from model.sampling.blocks import draw_blocks
from model.schedules import Schedule

__all__ = ["BlockDenoiser", "BlockDiffusion", "block_times", "spread_over_blocks"]


@runtime_checkable
class BlockDenoiser(Protocol):
    """A denoiser that can predict each block of z_t from that block and the clean blocks before it."""

    def given_clean(self, x0: Tensor, block_size: int) -> Denoiser:
        """A ``Denoiser`` of z_t [B, L] (x0's shape) whose output at block b depends on z_t's block b
        and x0's blocks < b only."""


def spread_over_blocks(t: Tensor, blocks: int) -> Tensor:
    """Row times [B] -> block times [B, blocks]: ``(t_i + b / blocks) mod 1``, each marginally
    U[0, 1) (the estimate stays unbiased) and a row's blocks spread evenly over [0, 1)."""
    offsets = torch.arange(blocks, dtype=torch.float64, device=t.device) / blocks
    return torch.remainder(t.to(torch.float64)[:, None] + offsets[None, :], 1.0)


def block_times(batch: int, blocks: int, generator: torch.Generator | None, *, offset: int = 0,
                global_batch_size: int | None = None) -> Tensor:
    """Low-discrepancy times [batch, blocks] over the global batch's ``G * blocks`` blocks: slot
    (i, b) of row ``offset + i`` is ``(u + ((offset + i) * blocks + b) / (G * blocks)) mod 1``."""
    global_batch_size = batch if global_batch_size is None else global_batch_size
    flat = low_discrepancy_times(batch * blocks, generator, offset=offset * blocks,
                                 global_batch_size=global_batch_size * blocks)
    return flat.view(batch, blocks)  # [batch * blocks] -> [batch, blocks], row-major like the slots


class BlockDiffusion(AbsorbingDiffusion):
    """The absorbing process over blocks of ``block_size`` tokens; see the module docstring.

    Sequence lengths must be multiples of ``block_size``. The denoiser must be a
    ``BlockDenoiser``. Everything else (schedules, endpoint terms, ``positions``, per-row
    generators, ``cross_entropy_chunk_rows``) is ``AbsorbingDiffusion``'s.
    """

    process_name = "absorbing (block diffusion)"

    def __init__(self, schedule: Schedule, vocab_size: int, block_size: int, *, validate: bool = True,
                 cross_entropy_chunk_rows: int = 0) -> None:
        super().__init__(schedule, vocab_size, validate=validate, cross_entropy_chunk_rows=cross_entropy_chunk_rows)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size

    def sample(self, denoiser: DenoiserLike, plan: SamplingPlan, *, num_samples: int, seq_len: int,
               prompt: Tensor | None = None, generator: Generators = None, window: int | None = None,
               device: torch.device | str | None = None, kv_cache: bool = True,
               on_block: Callable[[], None] | None = None) -> tuple[Tensor, SamplingStats]:
        """Block by block with a KV cache of the finished blocks (``model.sampling.blocks``):
        ``plan.sampler`` inside each block, any ``seq_len`` that is a multiple of the block size
        (past ``window`` the cache slides), stopping at ``plan.until_eos``. ``denoiser``: a
        ``Transformer``. ``kv_cache`` False recomputes the finished blocks at every call;
        ``on_block`` is called after each block."""
        return draw_blocks(self, self.sampler(plan.sampler), denoiser, plan, num_samples=num_samples,
                           seq_len=seq_len, prompt=prompt, generator=generator, window=window, device=device,
                           cache=kv_cache, on_block=on_block)

    def num_blocks(self, length: int) -> int:
        """L / L'; ValueError when the block size does not divide ``length``."""
        if length % self.block_size:
            raise ValueError(f"block_size {self.block_size} must divide the sequence length {length}")
        return length // self.block_size

    # ---------------------------------------------------------------- forward process
    def _block_times(self, t: Tensor, x0: Tensor) -> Tensor:
        """[B] or [B, blocks] times -> float64 [B, blocks] (checked)."""
        batch, blocks = x0.shape[0], self.num_blocks(x0.shape[1])
        if not isinstance(t, Tensor) or not t.is_floating_point() or t.shape not in ((batch,), (batch, blocks)):
            raise ValueError(f"t must be a floating-point tensor of shape [{batch}] or [{batch}, {blocks}] "
                             f"(one time per sequence or per block), got {getattr(t, 'shape', type(t).__name__)}")
        if self.validate and not bool(((t >= 0) & (t <= 1)).all()):
            raise ValueError(f"t must lie in [0, 1], got values in [{float(t.min())}, {float(t.max())}]")
        return spread_over_blocks(t, blocks) if t.dim() == 1 else t.to(torch.float64)

    def _corrupt(self, x0: Tensor, t: Tensor, generator: Generators,
                 positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Masks of z_t: ``t`` [B, blocks], or [B] for every block at its row's time (the t = 0 term)."""
        times = t.to(torch.float64)
        times = times[:, None].expand(-1, self.num_blocks(x0.shape[1])) if times.dim() == 1 else times
        rates = self.schedule.masking_rate(times)
        u = uniforms(x0.shape, generator, x0.device)  # the draws AbsorbingDiffusion makes
        masked = u < rates.to(x0.device).repeat_interleave(self.block_size, dim=1)  # [B, blocks] -> [B, L]
        if positions is not None:
            masked &= positions
        return torch.where(masked, self.mask_id, x0), masked

    # ---------------------------------------------------------------- bounds
    def nelbo_terms(self, denoiser: DenoiserLike, x0: Tensor, t: Tensor | None = None,
                    generator: Generators = None, *, reconstruction: Reconstruction = "model",
                    positions: Tensor | None = None) -> NelboTerms:
        """The per-block bound summed over blocks, its terms kept apart (docs/math.md#block-diffusion):
        the diffusion term sum_b w(t_b) sum_{n masked in block b} -log p(x_n | z^b, x^<b), and the
        endpoint terms of ``AbsorbingDiffusion``. ``t`` [B] or [B, blocks] (None: low-discrepancy
        row times over this batch, spread over the blocks)."""
        self._check_x0(x0, positions)
        check_reconstruction(reconstruction)
        if t is None:
            t = low_discrepancy_times(x0.shape[0], batch_generator(generator, "t"), device=x0.device)
        times = self._block_times(t, x0)                                              # [B, blocks]
        weight = self.schedule.weight(times).to(x0.device)                            # w(t_b)
        z_t, masked = self._corrupt(x0, times, generator, positions)
        return NelboTerms(
            t=t,
            diffusion=(weight * self.masked_nll(denoiser, z_t, None, x0, masked)).sum(-1),
            reconstruction=self._reconstruction(denoiser, x0, generator, reconstruction, positions),
            prior=self._prior(x0, positions),
            num_masked=masked.sum(-1),
        )

    def nelbo_discrete(self, denoiser: DenoiserLike, x0: Tensor, steps: int,
                       generator: Generators = None, *, u: Tensor | None = None,
                       positions: Tensor | None = None) -> Tensor:
        """The T-step bound of every block (grid i/T), one step per block picked by its
        uniform (``u`` [B] spread over the blocks, or [B, blocks]), endpoint terms as ``nelbo``."""
        self._check_x0(x0, positions)
        if u is None:
            u = low_discrepancy_times(x0.shape[0], batch_generator(generator, "u"), device=x0.device)
        uniform = self._block_times(u, x0)
        step = torch.floor(uniform * steps).clamp(max=steps - 1) + 1  # in {1, ..., T}, [B, blocks]
        t, s = step / steps, (step - 1) / steps
        alpha_t, alpha_s = self.schedule.alpha(t), self.schedule.alpha(s)
        step_weight = (steps * (alpha_s - alpha_t) / self.schedule.masking_rate(t)).to(x0.device)
        z_t, masked = self._corrupt(x0, t, generator, positions)
        return ((step_weight * self.masked_nll(denoiser, z_t, None, x0, masked)).sum(-1)
                + self._reconstruction(denoiser, x0, generator, "model", positions)
                + self._prior(x0, positions))

    def _block_denoiser(self, denoiser: DenoiserLike, x0: Tensor) -> Denoiser:
        """The denoiser of z_t given x0's clean blocks (``BlockDenoiser.given_clean``)."""
        if not isinstance(denoiser, BlockDenoiser):
            raise ValueError(f"block diffusion needs a denoiser that sees clean blocks (a BlockDenoiser: "
                             f"given_clean(x0, block_size)), got {type(denoiser).__name__}")
        return as_denoiser(denoiser.given_clean(x0, self.block_size))

    def _check_tokens(self, x: Tensor, name: str, *, allow_mask: bool) -> None:
        super()._check_tokens(x, name, allow_mask=allow_mask)
        self.num_blocks(x.shape[-1])
