"""ReMDM: its steps keep the forward marginals (cap, rescale, loop), the sampler follows its
steps, revealed tokens are masked again (never the prompt's), at most one call per step,
and with the exact conditionals it still draws from the data."""

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.sampling import RemaskOptions, SamplingPlan, time_grid
from model.sampling.remasking import remask_steps
from model.schedules import make_schedule
from tests.support.denoisers import ShapeRecorder
from tests.support.oracle import EnumerableDistribution
from tests.support.stats import chi_square_limit, chi_square_statistic

VOCAB = 3
OPTIONS = {"cap": RemaskOptions(schedule="cap", eta=0.05), "rescale": RemaskOptions(schedule="rescale", eta=0.5),
           "loop": RemaskOptions(schedule="loop", eta=0.1)}


def _masked_share(schedule, steps: int, grid: str, options: RemaskOptions) -> list[float]:
    """P(a position is masked) after each step, by the recursion of the reverse step."""
    plan = remask_steps(schedule, steps, grid, options)
    share = [float(schedule.masking_rate(torch.ones(1, dtype=torch.float64)))]
    for reveal, remask in zip(plan.reveal.tolist(), plan.remask.tolist()):
        share.append(share[-1] * (1 - reveal) + (1 - share[-1]) * remask)
    return share


@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("grid", ["uniform", "cosine"])
def test_every_step_keeps_the_forward_marginal(name, grid):
    """Masked with probability r(t) before the step gives r(s) after it (of tau(t) for the
    loop), whatever sigma: the ReMDM posterior's defining property."""
    schedule, steps, options = make_schedule("cosine"), 40, OPTIONS[name]
    plan = remask_steps(schedule, steps, grid, options)
    assert bool((plan.remask > 0).any()) and bool(((plan.reveal >= 0) & (plan.reveal <= 1)).all())
    expected = schedule.masking_rate(plan.time[1:]).tolist() + [0.0]
    torch.testing.assert_close(torch.tensor(_masked_share(schedule, steps, grid, options)[1:], dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_the_loop_remasks_only_between_t_on_and_t_off_with_alpha_held():
    schedule, options = make_schedule("linear"), RemaskOptions(schedule="loop", eta=0.02)
    plan = remask_steps(schedule, 100, "uniform", options)
    times = time_grid(100, "uniform")
    inside = (times[1:] >= options.t_off) & (times[:-1] <= options.t_on)
    assert bool((plan.remask[inside] == 0.02).all()) and bool((plan.remask[~inside] == 0).all())
    alpha = schedule.alpha(plan.time[inside])
    torch.testing.assert_close(alpha, torch.full_like(alpha, options.alpha_on))


@pytest.mark.parametrize("name", OPTIONS)
def test_the_sampler_follows_its_steps_and_remasks_revealed_tokens_only(name):
    """Every step calls the network on all rows (cache off), so the calls show the states: the
    share of masks follows the recursion, tokens are masked again, the prompt never is."""
    length, num, steps = 12, 400, 30
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    recorder = ShapeRecorder(torch.zeros(length, VOCAB))
    prompt = torch.full((length,), VOCAB)
    prompt[3] = 1
    plan = SamplingPlan(sampler="remdm", steps=steps, options=OPTIONS[name], cache=False)
    out, stats = diffusion.sample(recorder, plan, num_samples=num, seq_len=length, prompt=prompt,
                                  generator=torch.Generator().manual_seed(0))
    assert stats.network_calls == steps and bool((out < VOCAB).all()) and bool((out[:, 3] == 1).all())
    share = _masked_share(diffusion.schedule, steps, "uniform", OPTIONS[name])
    free = length - 1
    for z, expected in zip(recorder.inputs[1:], share[1:]):
        assert bool((z[:, 3] == 1).all())
        assert abs(float((z == VOCAB).sum()) / (num * free) - expected) < 0.03
    remasked = sum(int(((before != VOCAB) & (after == VOCAB)).sum())
                   for before, after in zip(recorder.inputs, recorder.inputs[1:]))
    assert remasked > 0


def test_at_most_one_call_per_step_and_none_without_a_reveal():
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    recorder = ShapeRecorder(torch.zeros(6, VOCAB))
    _, stats = diffusion.sample(recorder, SamplingPlan(sampler="remdm", steps=200), num_samples=3, seq_len=6)
    assert stats.network_calls <= 200 and max(stats.row_calls) <= 200
    assert all(bool((z == VOCAB).any(-1).all()) for z in recorder.inputs)  # a row is called to reveal a mask


def test_with_the_exact_conditionals_a_single_position_is_drawn_from_the_data():
    oracle = EnumerableDistribution.random(6, 1, torch.Generator().manual_seed(2))
    diffusion = AbsorbingDiffusion(make_schedule("linear"), 6)
    plan = SamplingPlan(sampler="remdm", steps=16, options=RemaskOptions(schedule="rescale", eta=1.0))
    samples, _ = diffusion.sample(oracle, plan, num_samples=20_000, seq_len=1, generator=torch.Generator().manual_seed(0))
    assert chi_square_statistic(samples, oracle.probs, oracle) < chi_square_limit(5)
