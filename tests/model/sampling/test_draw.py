"""Every sampler through the one entry point (``model.sampling.draw``): conditioning, seeds and
batch-size independence, the fixed shape option, semi-autoregressive blocks; and where host and
device tensors meet, checked on CPU with a pretend device (``tests.support.fake_device``): every
sampler runs with the tokens and the network on the device, passes the network only device
tensors, and draws exactly the samples of a CPU run (docs/sampling.md, "Host and device")."""

from dataclasses import replace

import pytest
import torch
from torch import Tensor

from model.absorbing import AbsorbingDiffusion
from model.denoiser import Denoiser
from model.learned import LearnedDiffusion, LearnedSchedule
from model.sampling import RemaskOptions, SamplingPlan, sample_generators
from model.schedules import make_schedule
from model.uniform import UniformDiffusion
from tests.support.denoisers import ShapeRecorder, TableDenoiser
from tests.support.fake_device import DEVICE, DeviceTensor, OnDevice, on_fake_device
from tests.support.oracle import EnumerableDistribution

PLANS = {"ancestral": SamplingPlan(steps=12), "first-hitting": SamplingPlan(sampler="first-hitting", steps=None),
         "first-hitting-k2": SamplingPlan(sampler="first-hitting", steps=2),
         "confidence": SamplingPlan(sampler="confidence", steps=3, grid="cosine"),
         "remdm": SamplingPlan(sampler="remdm", steps=12),
         "remdm-loop": SamplingPlan(sampler="remdm", steps=12, options=RemaskOptions(schedule="loop"))}


@pytest.fixture(scope="module")
def diffusion() -> AbsorbingDiffusion:
    return AbsorbingDiffusion(make_schedule("linear"), 3)


# ------------------------------------------------------------------ every sampler
@pytest.mark.parametrize("name", PLANS)
def test_prompt_is_kept_and_samples_hold_valid_tokens(oracle, diffusion, name):
    mask = diffusion.mask_id
    prompts = torch.tensor([[2, mask, mask, mask], [mask, mask, mask, 0], [1, mask, 2, mask]]).repeat(20, 1)
    out, stats = diffusion.sample(oracle, PLANS[name], num_samples=60, seq_len=4, prompt=prompts)
    assert out.shape == (60, 4) and out.dtype == torch.long and bool(((out >= 0) & (out < 3)).all())
    keep = prompts != mask
    assert bool((out[keep] == prompts[keep]).all())
    assert stats.network_calls >= 1 and len(stats.row_calls) == 60


@pytest.mark.parametrize("name", PLANS)
def test_a_sample_depends_on_its_seed_and_index_not_on_its_batch(oracle, diffusion, name):
    """Sample i of a seed draws from its own generator: the same in a batch of 6 or of 2 x 3."""
    plan = PLANS[name]
    together, _ = diffusion.sample(oracle, plan, num_samples=6, seq_len=4)
    assert torch.equal(together, diffusion.sample(oracle, plan, num_samples=6, seq_len=4)[0])
    halves = [diffusion.sample(oracle, plan, num_samples=3, seq_len=4, generator=sample_generators(plan.seed, range(first, first + 3)))[0]
              for first in (0, 3)]
    assert torch.equal(together, torch.cat(halves))
    other, _ = diffusion.sample(oracle, replace(plan, seed=1), num_samples=6, seq_len=4)
    assert not torch.equal(together, other)


@pytest.mark.parametrize("name", PLANS)
def test_a_fixed_input_shape_changes_nothing_but_the_rows_passed(oracle, diffusion, name):
    plan = PLANS[name]
    varying, varying_stats = diffusion.sample(oracle, plan, num_samples=8, seq_len=4)
    fixed, fixed_stats = diffusion.sample(oracle, replace(plan, static_shape=True), num_samples=8, seq_len=4)
    assert torch.equal(varying, fixed)
    assert fixed_stats.network_calls == varying_stats.network_calls
    assert fixed_stats.rows_evaluated == 8 * fixed_stats.network_calls >= varying_stats.rows_evaluated
    assert fixed_stats.row_calls == varying_stats.row_calls


@pytest.mark.parametrize("name", PLANS)
def test_blocks_generate_beyond_the_window_with_the_text_before_as_context(name):
    """Sequences of 10 from a network that takes 4 positions, in blocks of 2: every call sees
    at most 4 positions, the context before the block is the final text, and a prompt token
    in a later block is kept."""
    vocab, length, window = 5, 10, 4
    diffusion = AbsorbingDiffusion(make_schedule("linear"), vocab)
    recorder = ShapeRecorder(torch.randn(window, vocab, generator=torch.Generator().manual_seed(0)))
    prompt = torch.full((length,), vocab)
    prompt[0], prompt[7] = 3, 1
    plan = replace(PLANS[name], block_len=2, static_shape=True)  # every call sees all 3 rows
    out, _ = diffusion.sample(recorder, plan, num_samples=3, seq_len=length, prompt=prompt, window=window)
    assert bool((out < vocab).all()) and bool((out[:, 0] == 3).all()) and bool((out[:, 7] == 1).all())
    assert max(z.shape[1] for z in recorder.inputs) == window
    for z in recorder.inputs:  # the window [end - 4, end) of a block [end - 2, end)
        context = z[:, :-2]
        assert not bool((context == vocab).any())
        if context.shape[1]:
            assert any(torch.equal(context, out[:, s:s + 2]) for s in (0, 2, 4, 6))
    with pytest.raises(ValueError, match="seq_len 10 exceeds the network's window of 4"):
        diffusion.sample(recorder, PLANS[name], num_samples=1, seq_len=length, window=window)


def test_one_generator_for_the_whole_batch_is_accepted():
    """One generator for the batch (the old way): reproducible, but tied to the batch."""
    oracle = EnumerableDistribution.random(3, 4, torch.Generator().manual_seed(1))
    diffusion = AbsorbingDiffusion(make_schedule("linear"), 3)
    plan = SamplingPlan(steps=8)
    first, _ = diffusion.sample(oracle, plan, num_samples=5, seq_len=4, generator=torch.Generator().manual_seed(3))
    again, _ = diffusion.sample(oracle, plan, num_samples=5, seq_len=4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(first, again)


# ------------------------------------------------------------------ host and device
VOCAB, LENGTH, SAMPLES = 3, 4, 6
# Every sampler's plan, and the ancestral sampler's without its cache.
DEVICE_PLANS = {"ancestral": SamplingPlan(steps=12), "ancestral-uncached": SamplingPlan(steps=12, cache=False),
                "first-hitting": SamplingPlan(sampler="first-hitting", steps=None),
                "first-hitting-k2": SamplingPlan(sampler="first-hitting", steps=2),
                "confidence": SamplingPlan(sampler="confidence", steps=3, grid="cosine"),
                "remdm": SamplingPlan(sampler="remdm", steps=12),
                "remdm-loop": SamplingPlan(sampler="remdm", steps=12, options=RemaskOptions(schedule="loop"))}


def _processes() -> dict:
    return {"masked": AbsorbingDiffusion(make_schedule("linear"), VOCAB),
            "uniform": UniformDiffusion(make_schedule("linear"), VOCAB),
            "learned": LearnedDiffusion(LearnedSchedule(VOCAB), VOCAB)}


CASES = [("masked", name) for name in DEVICE_PLANS] + [("uniform", "ancestral"), ("learned", "ancestral"),
                                                ("learned", "confidence")]


def _sample_both_ways(process_name: str, plan: SamplingPlan, denoiser: Denoiser | None = None,
                      **options) -> tuple[Tensor, Tensor]:
    process = _processes()[process_name]
    denoiser = denoiser or TableDenoiser(VOCAB, LENGTH, seed=0, time_weight=0.5)
    on_host, _ = process.sample(denoiser, plan, num_samples=SAMPLES, seq_len=LENGTH, **options)
    with on_fake_device():
        on_device, _ = process.sample(OnDevice(denoiser), plan, num_samples=SAMPLES, seq_len=LENGTH, device=DEVICE,
                                      **options)
        assert isinstance(on_device, DeviceTensor)
        on_device = on_device.cpu()
    return on_host, on_device


def test_the_pretend_device_refuses_what_cuda_refuses_and_counts_host_reads():
    with on_fake_device() as device:
        on_device, on_host = torch.arange(4, device=DEVICE), torch.arange(4)
        with pytest.raises(RuntimeError, match="indices should be either on cpu or on the same device"):
            on_host[on_device > 1]                                   # a GPU's crash: host data, device mask
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            on_device + on_host
        with pytest.raises(RuntimeError, match="device type for generator"):
            torch.rand(4, generator=torch.Generator().manual_seed(0), device=DEVICE)
        with pytest.raises(TypeError, match="numpy"):
            on_device.numpy()
        on_device[on_host > 1] = 7                                    # host indices into a device tensor: fine
        on_device[[0]] = on_device[[1]] + torch.tensor(1)             # a list index, a 0-dim host scalar
        assert isinstance(on_device, DeviceTensor) and device.syncs == 0
        assert on_device.tolist() == [2, 1, 7, 7] and bool((on_device > 0).all()) and device.syncs == 2


@pytest.mark.parametrize(("process_name", "name"), CASES)
def test_every_sampler_runs_on_the_device_and_draws_the_samples_of_the_host(process_name, name):
    on_host, on_device = _sample_both_ways(process_name, DEVICE_PLANS[name])
    assert torch.equal(on_device, on_host)


@pytest.mark.parametrize("static_shape", [False, True])
@pytest.mark.parametrize("name", ["ancestral", "first-hitting", "confidence", "remdm"])
def test_blocks_and_a_fixed_shape_run_on_the_device(name, static_shape):
    mask = VOCAB
    prompt = torch.tensor([2, mask, mask, 1])
    plan = replace(DEVICE_PLANS[name], block_len=2, static_shape=static_shape)
    # A network of any length: each block passes the text so far.
    denoiser = ShapeRecorder(torch.randn(LENGTH, VOCAB, generator=torch.Generator().manual_seed(0)))
    on_host, on_device = _sample_both_ways("masked", plan, denoiser, prompt=prompt)
    assert torch.equal(on_device, on_host)
