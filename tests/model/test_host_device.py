"""Where host and device tensors meet, checked on CPU with a pretend device (``tests.support.fake_device``):
every sampler, semi-autoregressive blocks, block diffusion's KV-cache sampler and scoring, and the
bound estimator run with the tokens and the
network on the device, pass the network only device tensors, and give exactly the results of a
CPU run (issue 30: on a GPU ``unmask sample`` crashed where a host tensor met a device mask)."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import Tensor

from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from evaluation.bounds.estimator import Blocks, estimate_bound, per_time_contributions, replicate_terms
from evaluation.downstream.likelihoods import ScoringModel, ScoringSettings, score_continuations, score_documents
from evaluation.generation.generate import generate
from model.absorbing import AbsorbingDiffusion
from model.denoiser import Denoiser
from model.learned import LearnedDiffusion, LearnedSchedule
from model.sampling import RemaskOptions, SamplingPlan
from model.schedules import make_schedule
from model.uniform import UniformDiffusion
from pipeline.interchange.export import Exported, load_export
from tests.support.denoisers import ShapeRecorder, TableDenoiser
from tests.support.export_fixtures import write_untrained_export
from tests.support.fake_device import DEVICE, DeviceTensor, on_fake_device

VOCAB, LENGTH, SAMPLES = 3, 4, 6
# float32 attention by another of SDPA's kernels, summed over a few tokens: a few float32 ulps.
SDPA_KERNEL_RTOL = 1e-6
PLANS = {"ancestral": SamplingPlan(steps=12), "ancestral-uncached": SamplingPlan(steps=12, cache=False),
         "first-hitting": SamplingPlan(sampler="first-hitting", steps=None),
         "first-hitting-k2": SamplingPlan(sampler="first-hitting", steps=2),
         "confidence": SamplingPlan(sampler="confidence", steps=3, grid="cosine"),
         "remdm": SamplingPlan(sampler="remdm", steps=12),
         "remdm-loop": SamplingPlan(sampler="remdm", steps=12, options=RemaskOptions(schedule="loop"))}


class OnDevice(Denoiser):
    """``inner`` run as a network on the device: it takes device tensors only (z_t and t) and
    answers on the device."""

    def __init__(self, inner: Denoiser) -> None:
        self.inner = inner

    def logits(self, z_t: Tensor, t: Tensor) -> Tensor:
        for name, value in (("z_t", z_t), ("t", t)):
            assert isinstance(value, DeviceTensor), f"the network got {name} on {value.device}, not on the device"
        return self.inner.logits(z_t.cpu(), t.cpu()).to(DEVICE)

    @property
    def time_independent(self) -> bool:
        return self.inner.time_independent


def _processes() -> dict:
    return {"masked": AbsorbingDiffusion(make_schedule("linear"), VOCAB),
            "uniform": UniformDiffusion(make_schedule("linear"), VOCAB),
            "learned": LearnedDiffusion(LearnedSchedule(VOCAB), VOCAB)}


CASES = [("masked", name) for name in PLANS] + [("uniform", "ancestral"), ("learned", "ancestral"),
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
            on_host[on_device > 1]                                   # issue 30's crash
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
    on_host, on_device = _sample_both_ways(process_name, PLANS[name])
    assert torch.equal(on_device, on_host)


@pytest.mark.parametrize("static_shape", [False, True])
@pytest.mark.parametrize("name", ["ancestral", "first-hitting", "confidence", "remdm"])
def test_blocks_and_a_fixed_shape_run_on_the_device(name, static_shape):
    mask = VOCAB
    prompt = torch.tensor([2, mask, mask, 1])
    plan = replace(PLANS[name], block_len=2, static_shape=static_shape)
    # A network of any length: each block passes the text so far.
    denoiser = ShapeRecorder(torch.randn(LENGTH, VOCAB, generator=torch.Generator().manual_seed(0)))
    on_host, on_device = _sample_both_ways("masked", plan, denoiser, prompt=prompt)
    assert torch.equal(on_device, on_host)


# ------------------------------------------------------------------ the bound estimator
def _blocks() -> Blocks:
    tokens = torch.randint(0, VOCAB, (5, LENGTH), generator=torch.Generator().manual_seed(3))
    positions = torch.ones_like(tokens, dtype=torch.bool)
    positions[-1, 2:] = False   # a padded last block
    return Blocks(tokens, positions)


@pytest.mark.parametrize("process_name", ["masked", "uniform", "learned"])
def test_the_estimator_runs_on_the_device_and_gives_the_bound_of_the_host(process_name):
    process, blocks = _processes()[process_name], _blocks()
    denoiser = TableDenoiser(VOCAB, LENGTH, seed=1, time_weight=0.5)
    options = dict(samples_per_block=3, seed=2, batch_size=2)
    on_host = (estimate_bound(process, denoiser, blocks, **options),
               estimate_bound(process, denoiser, blocks, discrete_steps=4, **options),
               replicate_terms(process, denoiser, blocks, **options),
               per_time_contributions(process, denoiser, blocks, **options))
    with on_fake_device():
        network = OnDevice(denoiser)
        on_device = (estimate_bound(process, network, blocks, device=DEVICE, **options),
                     estimate_bound(process, network, blocks, discrete_steps=4, device=DEVICE, **options),
                     replicate_terms(process, network, blocks, device=DEVICE, **options),
                     per_time_contributions(process, network, blocks, device=DEVICE, **options))
    assert on_device[:2] == on_host[:2]
    np.testing.assert_array_equal(on_device[2], on_host[2])
    for device_column, host_column in zip(on_device[3], on_host[3]):
        np.testing.assert_array_equal(device_column, host_column)


# ------------------------------------------------------------------ exports: unmask sample and lm-eval
EXPORT_VOCAB, EXPORT_LENGTH = 300, 32
LINES = [f"the {animal} sat on the {place} at {i}." for i in range(200)
         for animal, place in [(("cat", "dog", "fox", "owl")[i % 4], ("mat", "log", "hill", "roof")[i * 3 % 4])]]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Exported]:
    root = tmp_path_factory.mktemp("host_device")
    tokenizer = train_sentencepiece(LINES, root / "tok", vocab_size=EXPORT_VOCAB)
    configs = {"masked": ("diffusion", {}, {}), "uniform": ("diffusion", {"process": "uniform"},
                                                            {"time_conditioning": True}),
               "learned": ("diffusion", {"process": "learned", "schedule": "learned"}, {}),
               "block": ("diffusion", {"block_size": 8}, {}),   # block diffusion: KV cache, given_clean
               "ar": ("autoregressive", {}, {})}
    return {name: load_export(write_untrained_export(root / name, tokenizer, root / "tok", objective=objective,
                                                     config=config, max_seq_len=EXPORT_LENGTH, **network))
            for name, (objective, config, network) in configs.items()}


GENERATION_CASES = [("masked", SamplingPlan(steps=8)), ("masked", SamplingPlan(sampler="first-hitting")),
                    ("masked", SamplingPlan(sampler="confidence", steps=4)), ("masked", SamplingPlan(sampler="remdm",
                                                                                                   steps=8)),
                    ("masked", SamplingPlan(steps=4, block_len=8)), ("uniform", SamplingPlan(steps=4)),
                    ("learned", SamplingPlan(steps=4)), ("ar", SamplingPlan()),
                    ("block", SamplingPlan(steps=4)), ("block", SamplingPlan(sampler="first-hitting")),
                    ("block", SamplingPlan(sampler="confidence", steps=4)), ("block", SamplingPlan(sampler="remdm",
                                                                                                 steps=8))]


@pytest.mark.parametrize(("name", "plan"), GENERATION_CASES)
def test_unmask_sample_runs_on_the_device_and_draws_the_samples_of_the_host(exports, name, plan):
    exported = exports[name]
    options = dict(num=3, seq_len=EXPORT_LENGTH + 8 if plan.block_len else 16, prompt="the cat", batch_size=2)
    on_host = generate(exported, plan, device="cpu", **options)
    with on_fake_device():
        try:
            on_device = generate(exported, plan, device=DEVICE.type, **options)
        finally:
            exported.network.to("cpu")   # the export is shared by the module's tests
    assert [s.tokens for s in on_device] == [s.tokens for s in on_host]
    assert [s.network_calls for s in on_device] == [s.network_calls for s in on_host]


@pytest.mark.parametrize("name", ["masked", "uniform", "learned", "block", "ar"])
def test_lm_eval_scoring_runs_on_the_device_and_gives_the_scores_of_the_host(exports, name):
    exported = exports[name]
    tokenizer = exported.tokenizer
    pairs = [(tokenizer.encode("the cat sat on"), tokenizer.encode(" the mat")),
             (tokenizer.encode("the dog"), tokenizer.encode(" sat on the log")),
             (tokenizer.encode("the cat sat on"), tokenizer.encode(" the hill"))]
    documents = [tokenizer.encode(line) for line in LINES[:3]]
    settings = ScoringSettings(samples=3, seed=1, batch_rows=2)

    def scores(device: torch.device) -> tuple[list, list]:
        model = ScoringModel.of(exported, device)
        return (score_continuations(model, pairs, settings),
                score_documents(model, documents, settings, eos_id=tokenizer.eos_id, pad_id=tokenizer.eos_id))

    on_host = scores(torch.device("cpu"))
    with on_fake_device():
        try:
            on_device = scores(DEVICE)
        finally:
            exported.network.to("cpu")   # the export is shared by the module's tests
    for device_scores, host_scores in zip(on_device, on_host):
        for device_score, host_score in zip(device_scores, host_scores):
            # The same draws; SDPA may pick another kernel for a tensor that is not on the CPU (float32 rounding).
            assert device_score.log_likelihood == pytest.approx(host_score.log_likelihood, rel=SDPA_KERNEL_RTOL)
            assert device_score.is_greedy == host_score.is_greedy
