"""Confidence-ordered unmasking: the most confident positions first (by max-prob or margin),
exactly one network call per step of the budget, counts that follow the schedule, the grid
time given to the network, and the learned process following it."""

import pytest
import torch

from model import LearnedDiffusion, LearnedSchedule
from model.absorbing import AbsorbingDiffusion
from model.sampling import ConfidenceOptions, SamplingPlan, time_grid
from model.sampling.confidence import masked_fraction
from model.schedules import make_schedule
from tests.support.denoisers import ConstantDenoiser, ShapeRecorder

VOCAB = 3


def _reveal_order(recorder: ShapeRecorder) -> list[int]:
    """The position revealed between consecutive calls of a one-row, one-per-step run."""
    states = [z[0] for z in recorder.inputs]
    order = []
    for before, after in zip(states, states[1:]):
        order += (before == VOCAB).logical_and(after != VOCAB).nonzero().flatten().tolist()
    return order


@pytest.mark.parametrize("score,expected", [("max-prob", [0, 1, 2, 3]), ("margin", [1, 3, 2, 0])])
def test_the_most_confident_positions_go_first(score, expected):
    """Position 0: probabilities (0.50, 0.49, 0.01): the most likely token, a thin margin.
    Position 1: (0.45, 0.30, 0.25): less likely, a wider margin. Positions 2 and 3 are
    flatter still, with margins 0.02 and 0.03. One token per step: the calls show the order."""
    probs = torch.tensor([[0.50, 0.49, 0.01], [0.45, 0.30, 0.25], [0.40, 0.38, 0.22], [0.36, 0.33, 0.31]])
    recorder = ShapeRecorder(probs.log())
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    plan = SamplingPlan(sampler="confidence", steps=4, options=ConfidenceOptions(score=score))
    diffusion.sample(recorder, plan, num_samples=1, seq_len=4)
    assert len(recorder.inputs) == 4
    assert _reveal_order(recorder)[:3] == expected[:3]


@pytest.mark.parametrize("steps", [1, 3, 7, 16])
def test_every_step_of_the_budget_is_one_call_and_counts_follow_the_schedule(steps):
    length = 16
    diffusion = AbsorbingDiffusion(make_schedule("cosine"), VOCAB)
    denoiser = ConstantDenoiser(torch.tensor([0.2, 0.3, 0.5]))
    plan = SamplingPlan(sampler="confidence", steps=steps, grid="cosine")
    out, stats = diffusion.sample(denoiser, plan, num_samples=5, seq_len=length)
    assert stats.row_calls == (steps,) * 5 and bool((out < VOCAB).all())
    assert [float(t[0]) for t in denoiser.calls] == time_grid(steps, "cosine")[:-1].tolist()
    masks = [int((z == VOCAB).sum()) // 5 for z in _inputs(diffusion, plan, length)]
    fraction = masked_fraction(diffusion, time_grid(steps, "cosine"))
    expected, left = [length], length
    for step in range(steps - 1):  # the schedule's count, kept within one per remaining step
        left = min(max(round(length * float(fraction[step + 1])), steps - step - 1), left - 1)
        expected.append(left)
    assert masks == expected


def _inputs(diffusion: AbsorbingDiffusion, plan: SamplingPlan, length: int) -> list[torch.Tensor]:
    recorder = ShapeRecorder(torch.tensor([[0.2, 0.3, 0.5]]).log().expand(length, -1))
    diffusion.sample(recorder, plan, num_samples=5, seq_len=length)
    return recorder.inputs


def test_more_steps_than_tokens_skip_the_steps_that_reveal_nothing():
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    _, stats = diffusion.sample(ConstantDenoiser(torch.full((VOCAB,), 1 / 3)), SamplingPlan(sampler="confidence", steps=50),
                                num_samples=2, seq_len=8)
    assert stats.row_calls == (8, 8)


def test_the_learned_process_follows_with_its_prompt_kept():
    process = LearnedDiffusion(LearnedSchedule(VOCAB, initial_exponent=2.0), VOCAB)
    prompt = torch.tensor([2, VOCAB, VOCAB, VOCAB, 0, VOCAB])
    with torch.no_grad():
        out, stats = process.sample(ConstantDenoiser(torch.tensor([0.2, 0.3, 0.5])),
                                    SamplingPlan(sampler="confidence", steps=3), num_samples=4, seq_len=6,
                                    prompt=prompt)
    assert bool((out[:, 0] == 2).all()) and bool((out[:, 4] == 0).all()) and bool((out < VOCAB).all())
    assert stats.row_calls == (3,) * 4
