"""Self-distillation through time (SDTT): a student learns to do in one sampling step what its
teacher does in two.

A step draws t on the student's uniform time grid (N student steps: t in {1/N, ..., 1}) and
z_t ~ q(z_t | x0) as the bound does; the frozen teacher takes two ancestral steps of 1 / 2N from
z_t (reveal-then-draw, the absorbing sampler's step), and each position masked in z_t gets as
target the teacher's logits at the call that revealed it, or its second call's for one still
masked. The loss is the divergence (``distill.divergence``) between the student's prediction
at z_t and those targets, summed over the masked positions (nats per token of the batch).
Rounds halve the steps; at a round's first step the student's EMA weights become the teacher
(``distill.refresh_teacher``) and are written to RUN/distill/teacher-round-K.safetensors, which
a resume in round K reads back: the run resumes bit for bit on CPU. What a caller relies on:
the objective protocol of ``pipeline.training.objective`` (``Distillation.loss_sum``).
The manual: docs/fast-generation.md#self-distillation.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_model, save_model
from torch import Tensor, nn

from common.errors import UserError
from model.absorbing import AbsorbingDiffusion
from model.denoiser import DenoiserLike, as_denoiser
from model.generators import Generators, uniforms
from model.positions import sum_by_row
from model.process import low_discrepancy_times
from model.sampling.core import inverse_cdf
from model.spec import ModelSpec, build_network
from pipeline.config import DistillSection
from pipeline.training.build import TrainingParts
from pipeline.training.ema import EMA
from pipeline.training.objective import EngineDenoiser, MicroBatchSlot, row_generators, step_generator
from pipeline.training.validation import evaluating

__all__ = ["DIVERGENCES", "Distillation", "distillation_loss", "distillation_of", "divergence", "rounds_line", "student_times",
           "teacher_file", "teacher_targets"]

log = logging.getLogger("unmask.train")

TEACHER_DIR = "distill"


def _reverse_kl(student: Tensor, target: Tensor) -> Tensor:
    return (student.exp() * (student - target)).sum(-1)


def _forward_kl(student: Tensor, target: Tensor) -> Tensor:
    return (target.exp() * (target - student)).sum(-1)


def _mse(student: Tensor, target: Tensor) -> Tensor:
    return (student - target).square().mean(-1)


def _tvd(student: Tensor, target: Tensor) -> Tensor:
    return 0.5 * (student.exp() - target.exp()).abs().sum(-1)


# Each takes the log-probabilities [N, V] of the student and of the target (float32) and gives [N].
# MSE compares log-probabilities rather than raw logits: logits are defined up to a constant per row.
DIVERGENCES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "reverse_kl": _reverse_kl, "forward_kl": _forward_kl, "mse": _mse, "tvd": _tvd}


def divergence(name: str, student_logits: Tensor, target_logits: Tensor) -> Tensor:
    """``name``'s divergence of each row [N] between the student's and the target's logits [N, V]."""
    return DIVERGENCES[name](F.log_softmax(student_logits.float(), -1), F.log_softmax(target_logits.float(), -1))


def student_times(u: Tensor, student_steps: int) -> Tensor:
    """Times in (0, 1] [B] on the student's uniform grid {1/N, ..., 1} from uniforms ``u`` [B] in [0, 1)."""
    return ((u * student_steps).floor() + 1.0) / student_steps


def _reveal_probability(process: AbsorbingDiffusion, t: Tensor, s: Tensor) -> Tensor:
    """The chance [B] that a position masked at t is revealed by s < t (1 at s = 0, as the sampler's last step)."""
    alpha_t, alpha_s = process.schedule.alpha(t), process.schedule.alpha(s)
    return torch.where(s <= 0, 1.0, (alpha_s - alpha_t) / (1.0 - alpha_t))


@torch.no_grad()
def teacher_targets(teacher: DenoiserLike, process: AbsorbingDiffusion, z_t: Tensor, masked: Tensor, t: Tensor,
                    step: float, generator: Generators) -> Tensor:
    """The teacher's two ancestral steps of size ``step`` from z_t at t [B] (float64): its logits
    [N, V] at the N masked positions (row-major), each from the call that revealed it (the
    first), else the second's. ``generator``: the row generators the reveal coins and tokens use."""
    teacher, vocab = as_denoiser(teacher), process.vocab_size
    s = (t - step).clamp(min=0.0)
    first = teacher.logits_at(z_t, t.to(z_t.device), masked)[:, :vocab].float()        # [N, V]
    u = uniforms((z_t.shape[0], 2, z_t.shape[1]), generator, z_t.device)                # [B, 2, L]
    revealed = masked & (u[:, 0] < _reveal_probability(process, t, s).to(z_t.device)[:, None])
    first_revealed = revealed[masked]                                                    # [N]
    z_s = z_t.clone()
    z_s[revealed] = inverse_cdf(torch.softmax(first[first_revealed].double(), -1), u[:, 1][revealed])
    still = masked & ~revealed
    targets = first.clone()
    if bool(still.any()):
        targets[~first_revealed] = teacher.logits_at(z_s, s.to(z_t.device), still)[:, :vocab].float()
    return targets


def distillation_loss(student: DenoiserLike, teacher: DenoiserLike, process: AbsorbingDiffusion, x0: Tensor,
                      t: Tensor, step: float, generator: Generators, name: str) -> Tensor:
    """The divergence summed over each sequence's masked positions [B] (float64): z_t drawn
    from ``generator`` at t [B], the teacher's targets by ``teacher_targets`` (docs/math.md#the-bound's
    z_t; module docstring for the rest)."""
    z_t, masked = process._corrupt(x0, t, generator)
    targets = teacher_targets(teacher, process, z_t, masked, t, step, generator)
    predicted = as_denoiser(student).logits_at(z_t, t.to(x0.device), masked)[:, :process.vocab_size]
    rows = torch.div(masked.flatten().nonzero().squeeze(1), x0.shape[1], rounding_mode="floor")
    return sum_by_row(divergence(name, predicted, targets), rows, x0.shape[0])


def distillation_of(parts: TrainingParts, run_dir: Path) -> Distillation:
    """The objective of the run of ``parts`` (``distill.enabled``), keeping its teachers in ``run_dir``."""
    process = parts.bound.diffusion  # the config's checks admit the absorbing process alone
    return Distillation(parts.config.distill, process, parts.engine, parts.ema, parts.config.model.spec(parts.network),
                        run_dir, parts.dist.is_main)


def teacher_file(run_dir: Path, round_: int) -> Path:
    """Where round ``round_``'s teacher is kept in the run directory."""
    return run_dir / TEACHER_DIR / f"teacher-round-{round_}.safetensors"


class Distillation:
    """The objective of an ``unmask distill`` run: the student is the trained engine, the
    teacher a frozen copy of the network (eval mode, no gradient, the run's dtype)."""

    def __init__(self, section: DistillSection, process: AbsorbingDiffusion, engine: nn.Module, ema: EMA,
                 spec: ModelSpec, run_dir: Path, is_main: bool) -> None:
        self.section, self.process, self.engine, self.ema = section, process, engine, ema
        self.run_dir, self.is_main = run_dir, is_main
        student = engine.module
        parameter = next(student.parameters())
        self.network = build_network(spec).to(parameter.device, parameter.dtype).eval().requires_grad_(False)
        self.teacher = EngineDenoiser(self.network)
        self.round, self.teacher_round = 0, None  # the step's round, and the round whose teacher self.network holds
        if is_main:
            log.info("%s", rounds_line(section))

    def loss_sum(self, model: DenoiserLike, x0: Tensor, slot: MicroBatchSlot) -> Tensor:
        if self.teacher_round is None or slot.micro == 0:
            self._begin(slot.step)
        student_steps = self.section.teacher_steps(self.round) // 2
        batch, time_gen = x0.shape[0], step_generator(torch.device("cpu"), slot.seed, slot.step)
        u = low_discrepancy_times(batch, time_gen, offset=slot.offset(batch), global_batch_size=slot.global_batch(batch))
        t = student_times(u, student_steps).to(x0.device)
        step = 1.0 / (2 * student_steps)
        return distillation_loss(model, self.teacher, self.process, x0, t, step, row_generators(x0.device, slot, batch),
                                 self.section.divergence).sum()

    def state_metrics(self, module: nn.Module) -> dict[str, float]:
        teacher_steps = self.section.teacher_steps(self.round)
        return {"distill/round": float(self.round), "distill/teacher_steps": float(teacher_steps),
                "distill/student_steps": float(teacher_steps // 2)}

    def _begin(self, step: int) -> None:
        """Before ``step``'s first micro-batch: the round's teacher, taken from the student at the
        round's first step, else read back from the run directory (a resume)."""
        section = self.section
        self.round = section.round_of(step)
        teacher_round = self.round if section.refresh_teacher else 0
        if step == teacher_round * section.round_steps:
            self._take_student(teacher_round)
        elif self.teacher_round != teacher_round:
            path = teacher_file(self.run_dir, teacher_round)
            if not path.is_file():
                raise UserError(f"{path}: round {teacher_round}'s teacher is missing, so the run cannot resume in "
                                f"that round; distil again in a new --run-dir")
            load_model(self.network, str(path), device=str(next(self.network.parameters()).device))
        self.teacher_round = teacher_round

    @torch.no_grad()
    def _take_student(self, round_: int) -> None:
        """The student's EMA weights become the teacher's, kept in the run directory (rank 0)."""
        student = self.engine.module
        with evaluating(self.engine, self.ema), _gathered(student):
            theirs = dict(student.named_parameters())
            for name, mine in self.network.named_parameters():
                mine.copy_(theirs[name].data.view(mine.shape))
        if self.is_main:
            path = teacher_file(self.run_dir, round_)
            path.parent.mkdir(exist_ok=True)
            staging = path.with_name(f".{path.name}.{os.getpid()}")
            save_model(self.network, str(staging))
            os.replace(staging, path)


def _gathered(module: nn.Module) -> contextlib.AbstractContextManager:
    """ZeRO-3's partitioned parameters gathered whole inside the block (nothing to do otherwise)."""
    if not any(hasattr(p, "ds_tensor") for p in module.parameters()):
        return contextlib.nullcontext()
    import deepspeed  # imported when needed: a run without ZeRO-3 does not need it here

    return deepspeed.zero.GatheredParameters(list(module.parameters()))


def rounds_line(section: DistillSection) -> str:
    """The plan of a distillation, for the log: its rounds' teacher and student steps."""
    steps = [section.teacher_steps(k) for k in range(section.rounds)]
    return (f"distillation: {section.rounds} round(s) of {section.round_steps} steps, teacher steps "
            f"{' -> '.join(map(str, steps))} -> student {steps[-1] // 2}, {section.divergence}, teacher "
            f"{'refreshed each round' if section.refresh_teacher else 'fixed'}")

