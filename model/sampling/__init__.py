"""Samplers of the diffusion processes, and the one plan they share.

    from model.sampling import SamplingPlan
    plan = SamplingPlan(sampler="first-hitting", top_p=0.9, seed=1)
    tokens, stats = diffusion.sample(network, plan, num_samples=4, seq_len=128)

- ``plan``: ``SamplingPlan`` (sampler, budget, grid, temperature, nucleus, seed, blocks,
  the sampler's options) and its validation;
- ``draw``: the entry point every process's ``sample`` runs (conditioning, one generator per
  sample, semi-autoregressive blocks);
- ``ancestral``: ``ancestral_sample`` (absorbing, cached network calls) and ``reverse_sample``
  (any process by its reverse kernel);
- ``first_hitting``: the exact first-hitting sampler (Zheng et al. 2024);
- ``confidence``: confidence-ordered unmasking (MaskGIT, LLaDA);
- ``remasking``: ReMDM (Wang et al. 2025);
- ``threshold``: threshold decoding (Fast-dLLM), as many tokens per call as pass a confidence threshold;
- ``window``: the network of semi-autoregressive generation, with its prefix cache and guidance;
- ``blocks``: block diffusion's block-by-block sampler with a KV cache;
- ``core``: what they share (token distribution, float64 draws, per-row uniforms, network calls).

Which sampler applies to which process is each process's ``samplers`` (``model.absorbing``).
The guide: docs/sampling.md.
"""

from model.sampling.ancestral import ancestral_sample, reverse_sample
from model.sampling.confidence import confidence_sample
from model.sampling.core import (
    NetworkCalls,
    SamplingStats,
    inverse_cdf,
    row_uniforms,
    sample_generators,
    time_grid,
    token_probs,
    top_p_filter,
)
from model.sampling.draw import Sampler, draw
from model.sampling.first_hitting import first_hitting_sample
from model.sampling.plan import (
    COMPILE_SETTINGS,
    CONFIDENCE_SCORES,
    GRIDS,
    MAX_SAMPLE_LEN,
    MAX_STEPS,
    MAX_STEPS_PER_POSITION,
    REMASK_SCHEDULES,
    SAMPLERS,
    ConfidenceOptions,
    PlanError,
    RemaskOptions,
    SamplerOptions,
    SamplingPlan,
    ThresholdOptions,
    check_budget,
    parse_sampler_options,
)
from model.sampling.remasking import remask_sample
from model.sampling.threshold import threshold_sample

__all__ = ["COMPILE_SETTINGS", "CONFIDENCE_SCORES", "GRIDS", "MAX_SAMPLE_LEN", "MAX_STEPS", "MAX_STEPS_PER_POSITION",
           "REMASK_SCHEDULES", "SAMPLERS", "ConfidenceOptions", "NetworkCalls", "PlanError", "RemaskOptions", "Sampler",
           "SamplerOptions", "SamplingPlan", "SamplingStats", "ThresholdOptions",
           "ancestral_sample", "check_budget", "confidence_sample", "draw", "first_hitting_sample", "inverse_cdf",
           "parse_sampler_options", "remask_sample", "reverse_sample", "row_uniforms", "sample_generators",
           "threshold_sample", "time_grid", "token_probs", "top_p_filter"]
