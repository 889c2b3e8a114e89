"""Masked diffusion math and networks: schedules, the diffusion process and its bounds,
the sampler, the transformer denoiser and the autoregressive baseline. No I/O, no
distributed code."""

from model.diffusion import DiffusionProcess, MaskedDiffusion, NelboTerms, low_discrepancy_times
from model.schedules import make_schedule
from model.state_dependent import LearnedMaskedDiffusion, LearnedSchedule
from model.uniform import UniformDiffusion

__all__ = ["DiffusionProcess", "LearnedMaskedDiffusion", "LearnedSchedule", "MaskedDiffusion", "NelboTerms",
           "UniformDiffusion", "low_discrepancy_times", "make_schedule"]
