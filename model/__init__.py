"""Masked diffusion math and networks: schedules, the diffusion processes and their bounds,
the samplers, the denoiser interface, the transformer denoiser, the autoregressive baseline
and the spec a model is built from. No I/O, no distributed code. The guide:
docs/model-api.md; the math: docs/math.md."""

from model.absorbing import AbsorbingDiffusion
from model.denoiser import Denoiser, FunctionDenoiser, as_denoiser
from model.learned import LearnedDiffusion, LearnedSchedule
from model.process import DiffusionProcess, NelboTerms, low_discrepancy_times
from model.schedules import make_schedule
from model.spec import ModelSpec, build_network, build_process, build_trainable
from model.trainable import NetworkWithSchedule
from model.uniform import UniformDiffusion

__all__ = ["AbsorbingDiffusion", "Denoiser", "DiffusionProcess", "FunctionDenoiser", "LearnedDiffusion",
           "LearnedSchedule", "ModelSpec", "NelboTerms", "NetworkWithSchedule", "UniformDiffusion", "as_denoiser",
           "build_network", "build_process", "build_trainable", "low_discrepancy_times", "make_schedule"]
