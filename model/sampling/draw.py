"""The one entry point of every sampler: conditioning, generators, semi-autoregressive blocks.

``draw(process, sampler, denoiser, plan, ...)`` is what ``DiffusionProcess.sample`` runs: the
starting tokens from the prompt (kept tokens, ``generate_id`` where to generate), one generator
per sample from ``plan.seed`` unless given, then ``sampler`` over the whole sequence or, with
``plan.block_len``, block by block left to right, each block seeing at most ``window``
positions (MDLM's semi-autoregressive generation), or with ``plan.whole_sequence`` the whole
sequence (LLaDA's). ``plan.whole_sequence``, the caches and ``plan.guidance`` run the network
through ``model.sampling.window``. docs/sampling.md#semi-autoregressive-blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from model.checks import check_positive_int, check_token_ids
from model.denoiser import DenoiserLike, as_denoiser
from model.generators import Generators
from model.sampling.core import NetworkCalls, SampledProcess, SamplingStats, sample_generators
from model.sampling.plan import SamplingPlan, check_budget
from model.sampling.window import WindowCalls, WindowNetwork

__all__ = ["Sampler", "draw", "initial_tokens"]

# A sampler: (process, plan, starting tokens [B, L], generators, network calls) -> tokens [B, L].
Sampler = Callable[[Any, SamplingPlan, Tensor, Generators, NetworkCalls], Tensor]


def initial_tokens(process: SampledProcess, num_samples: int, seq_len: int, prompt: Tensor | None,
                   device: torch.device | str | None) -> Tensor:
    """The prompt (or nothing) as [num_samples, seq_len], with ``generate_id`` where to generate, on
    ``device`` (None: the prompt's, else the CPU)."""
    device = torch.device(device) if device is not None else (
        prompt.device if prompt is not None else torch.device("cpu"))
    if prompt is None:
        return torch.full((num_samples, seq_len), process.generate_id, dtype=torch.long, device=device)
    if prompt.dim() == 1:
        prompt = prompt.unsqueeze(0).expand(num_samples, -1)
    if prompt.dim() != 2 or prompt.shape != (num_samples, seq_len):
        raise ValueError(f"prompt must have shape [{seq_len}] or [{num_samples}, {seq_len}], "
                         f"got {tuple(prompt.shape)}")
    check_token_ids(prompt, "prompt", process.generate_id, check_values=process.validate)
    return prompt.to(device).clone()


def _check_window(plan: SamplingPlan, seq_len: int, window: int | None) -> None:
    if window is None:
        return
    check_positive_int("window", window)
    if plan.whole_sequence and seq_len > window:
        raise ValueError(f"whole_sequence shows the network all {seq_len} positions, more than its window of "
                         f"{window}: shorten the sequence or leave whole_sequence out")
    if plan.block_len is None and seq_len > window:
        raise ValueError(f"seq_len {seq_len} exceeds the network's window of {window} positions: "
                         f"generate in blocks (block_len <= {window})")
    if plan.block_len is not None and plan.block_len > window:
        raise ValueError(f"block_len {plan.block_len} exceeds the network's window of {window} positions")


def draw(process: SampledProcess, sampler: Sampler, denoiser: DenoiserLike, plan: SamplingPlan, *,
         num_samples: int, seq_len: int, prompt: Tensor | None = None, generator: Generators = None,
         window: int | None = None, device: torch.device | str | None = None) -> tuple[Tensor, SamplingStats]:
    """Sample ``num_samples`` sequences of ``seq_len`` tokens with ``sampler`` (module docstring).

    ``prompt``: LongTensor [seq_len] or [num_samples, seq_len], tokens to keep and
    ``process.generate_id`` where to generate (a prefix, a suffix, any infilling pattern).
    ``generator``: one generator, or one per sample; None: ``sample_generators(plan.seed,
    range(num_samples))``. ``window``: the most positions the network takes (None: no limit).
    Returns the tokens [num_samples, seq_len] and what they cost.
    """
    check_positive_int("num_samples", num_samples)
    check_positive_int("seq_len", seq_len)
    if plan.until_eos is not None:
        raise ValueError("until_eos stops a block diffusion model's generation (model.block_size); this model "
                         "samples the whole sequence at once")
    if plan.whole_sequence and not hasattr(process, "mask_id"):
        raise ValueError(f"whole_sequence: its network sees the suffix masked, which only the absorbing process "
                         f"has; this one ({type(process).__name__}) samples without it")
    _check_window(plan, seq_len, window)
    check_budget(plan, seq_len)  # before the time grid is built
    z = initial_tokens(process, num_samples, seq_len, prompt, device)
    generator = sample_generators(plan.seed, range(num_samples)) if generator is None else generator
    windowed = (plan.prefix_cache is not None or plan.dual_cache is not None or plan.guidance is not None
                or plan.whole_sequence)
    if windowed:   # a caller may pass its own WindowNetwork (one that watches the calls: bench/sampler_quality.py)
        if not isinstance(denoiser, WindowNetwork):
            denoiser = WindowNetwork(as_denoiser(denoiser), plan, num_samples, process.generate_id)
        network = WindowCalls(denoiser, num_samples, process.vocab_size, static_shape=plan.static_shape)
    else:
        network = NetworkCalls(as_denoiser(denoiser), num_samples, process.vocab_size, static_shape=plan.static_shape)
    prompt = z != process.generate_id     # the kept tokens, which guidance masks in its second pass
    if plan.block_len is None:
        if windowed:
            denoiser.start(0, prompt)
        z = sampler(process, plan, z, generator, network)
    else:
        z = _in_blocks(process, sampler, plan, z, generator, network, window, prompt)
    return z, network.stats(plan.steps)


def _in_blocks(process: SampledProcess, sampler: Sampler, plan: SamplingPlan, z: Tensor, generator: Generators,
               network: NetworkCalls, window: int | None, prompt: Tensor) -> Tensor:
    """Blocks of ``plan.block_len`` left to right, each with the text before it as context (and
    with ``plan.whole_sequence`` the text after it, shown to the network only); ``prompt`` (bool
    [B, L]): the kept tokens."""
    length = z.shape[1]
    for start in range(0, length, plan.block_len):
        end = min(start + plan.block_len, length)
        first = 0 if window is None or plan.whole_sequence else max(0, end - window)
        part = z[:, first:end]                      # [B, W]: kept context, then the block
        if bool((part == process.generate_id).any()):
            if isinstance(network, WindowCalls):
                seen = length if plan.whole_sequence else end
                suffix = z[:, end:] if plan.whole_sequence else None   # [B, S]: masked, or a prompt's kept tokens
                network.denoiser.start(start - first, prompt[:, first:seen], suffix)
            z[:, first:end] = sampler(process, plan, part.clone(), generator, network)
    return z
