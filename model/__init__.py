"""Masked diffusion math and networks: schedules, the diffusion processes and their bounds,
the samplers, the denoiser interface, the transformer denoiser, the autoregressive baseline
and the spec a model is built from. No I/O, no distributed code."""

from model.denoiser import Denoiser, FunctionDenoiser, as_denoiser
from model.diffusion import DiffusionProcess, MaskedDiffusion, NelboTerms, low_discrepancy_times
from model.schedules import make_schedule
from model.spec import ModelSpec, build_network, build_process, build_trainable
from model.state_dependent import LearnedMaskedDiffusion, LearnedSchedule
from model.trainable import DiffusionModel
from model.uniform import UniformDiffusion

__all__ = ["Denoiser", "DiffusionModel", "DiffusionProcess", "FunctionDenoiser", "LearnedMaskedDiffusion",
           "LearnedSchedule", "MaskedDiffusion", "ModelSpec", "NelboTerms", "UniformDiffusion", "as_denoiser",
           "build_network", "build_process", "build_trainable", "low_discrepancy_times", "make_schedule"]
