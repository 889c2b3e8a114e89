"""The network of semi-autoregressive generation (``model.sampling.window``): the approximate prefix
cache (refreshed at every call it is the uncached sampler bit for bit; between refreshes the block
runs alone on the context's cached keys and values) and unsupervised classifier-free guidance
(w = 0 is the conditional model; the second pass masks the prompt; two passes counted a call)."""

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.block_diffusion import BlockDiffusion
from model.sampling import PlanError, SamplingPlan, sample_generators
from model.sampling.window import WindowNetwork
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig
from tests.support.denoisers import ShapeRecorder

VOCAB = 11
PLANS = [SamplingPlan(sampler="ancestral", steps=6), SamplingPlan(sampler="first-hitting"),
         SamplingPlan(sampler="confidence", steps=4), SamplingPlan(sampler="remdm", steps=6),
         SamplingPlan(sampler="threshold")]


def _network(dtype=torch.float32, time_conditioning=False) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=VOCAB, n_layers=2, d_model=32, n_heads=4, max_seq_len=16,
                               time_conditioning=time_conditioning)
    return Transformer(config).to(dtype).eval()


def _prompt() -> torch.Tensor:
    prompt = torch.full((24,), VOCAB)
    prompt[:5] = torch.tensor([1, 2, 3, 4, 5])
    return prompt


def _sample(network, plan, **kwargs):
    process = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    with torch.no_grad():
        return process.sample(network, plan, seq_len=24, prompt=_prompt(), window=16, **kwargs)


@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: plan.sampler)
@pytest.mark.parametrize("time_conditioning", [False, True])
def test_a_prefix_cache_refreshed_at_every_call_is_no_cache_bit_for_bit(plan, time_conditioning):
    network = _network(time_conditioning=time_conditioning)
    blocks = {"block_len": 8}
    plain, plain_stats = _sample(network, SamplingPlan(**{**plan.__dict__, **blocks}), num_samples=3)
    cached, stats = _sample(network, SamplingPlan(**{**plan.__dict__, **blocks, "prefix_cache": 1}), num_samples=3)
    assert torch.equal(plain, cached) and stats == plain_stats


def _window_lengths(network: Transformer) -> list[int]:
    lengths: list[int] = []
    network.embed.register_forward_hook(lambda module, args, out: lengths.append(args[0].shape[1]))
    return lengths


def test_between_refreshes_the_block_runs_alone():
    network = _network()
    lengths = _window_lengths(network)
    plan = SamplingPlan(sampler="confidence", steps=4, block_len=8, prefix_cache=3)
    _, stats = _sample(network, plan, num_samples=1)
    # block 1 holds the prompt and 3 masks: 3 calls, no context; blocks 2 and 3: 4 calls each in a
    # window of 16, the full window at the refreshes (calls 1 and 4), the block's 8 rows between them
    assert stats.row_calls == (11,)
    assert lengths == [8] * 3 + [16, 8, 8, 16] * 2


def test_the_cached_context_is_the_one_of_the_last_refresh():
    """float64: a call whose window did not change since the refresh gives the full forward's logits."""
    network = _network(torch.float64)
    window = WindowNetwork(network, SamplingPlan(block_len=8, prefix_cache=4), 2, VOCAB)
    z = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    z[:, 10:] = VOCAB
    window.start(8, torch.zeros_like(z, dtype=torch.bool))
    selected = z == VOCAB
    with torch.no_grad():
        full = network.logits_at(z, None, selected)
        torch.testing.assert_close(window.logits_at(z, None, selected), full, rtol=0, atol=0)   # refresh
        torch.testing.assert_close(window.logits_at(z, None, selected), full, rtol=0, atol=1e-12)  # cached
        changed = z.clone()
        changed[:, 10:12] = 3   # the block moves on: the cached context is now stale (the approximation)
        assert not torch.allclose(window.logits_at(changed, None, changed == VOCAB),
                                  network.logits_at(changed, None, changed == VOCAB), rtol=0, atol=1e-9)


def test_with_a_prefix_cache_a_sample_does_not_depend_on_its_batch():
    network = _network()
    plan = SamplingPlan(sampler="ancestral", steps=6, block_len=8, prefix_cache=2, seed=4)
    together, _ = _sample(network, plan, num_samples=3)
    for index in range(3):
        alone, _ = _sample(network, plan, num_samples=1, generator=sample_generators(plan.seed, [index]))
        assert torch.equal(alone[0], together[index])


@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: plan.sampler)
def test_guidance_at_weight_zero_is_the_conditional_model_at_twice_the_calls(plan):
    network = _network()
    plain, plain_stats = _sample(network, SamplingPlan(**{**plan.__dict__, "block_len": 8}), num_samples=2)
    guided, stats = _sample(network, SamplingPlan(**{**plan.__dict__, "block_len": 8, "guidance": 0.0}),
                            num_samples=2)
    assert torch.equal(plain, guided)
    assert stats.row_calls == tuple(2 * calls for calls in plain_stats.row_calls)
    assert stats.network_calls == 2 * plain_stats.network_calls


def test_guidance_masks_the_prompt_in_its_second_pass_and_extrapolates_from_it():
    logits = torch.randn(6, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    recorder = ShapeRecorder(logits)
    prompt = torch.tensor([0, 1, 3, 3, 2, 3])
    window = WindowNetwork(recorder, SamplingPlan(guidance=1.5), 1, 3)
    window.start(0, (prompt != 3)[None])
    out = window.logits(prompt[None], torch.ones(1))
    assert torch.equal(recorder.inputs[0][0], prompt)
    assert torch.equal(recorder.inputs[1][0], torch.full((6,), 3))   # every kept token masked
    # the recorder ignores its input: cond == un, so guidance adds nothing
    torch.testing.assert_close(out[0], logits.float())


def test_guidance_changes_the_samples():
    network = _network()
    plain, _ = _sample(network, SamplingPlan(sampler="ancestral", steps=6, block_len=8), num_samples=3)
    guided, _ = _sample(network, SamplingPlan(sampler="ancestral", steps=6, block_len=8, guidance=3.0), num_samples=3)
    assert not torch.equal(plain, guided) and torch.equal(guided[:, :5], plain[:, :5])


@pytest.mark.parametrize("fields,field", [({"prefix_cache": 2}, "prefix_cache"),
                                          ({"prefix_cache": 0, "block_len": 4}, "prefix_cache"),
                                          ({"prefix_cache": 2, "block_len": 4, "static_shape": True}, "prefix_cache"),
                                          ({"guidance": -1.0}, "guidance"),
                                          ({"guidance": float("nan")}, "guidance")])
def test_bad_options_name_their_field(fields, field):
    with pytest.raises(PlanError) as caught:
        SamplingPlan(**fields)
    assert caught.value.field == field


def test_the_plan_records_them_only_when_set():
    assert "prefix_cache" not in SamplingPlan().to_dict() and "guidance" not in SamplingPlan().to_dict()
    for plan in (SamplingPlan(block_len=8, prefix_cache=4), SamplingPlan(guidance=0.5)):
        assert SamplingPlan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("fields", [{"prefix_cache": 2, "block_len": 4}, {"guidance": 1.0}])
def test_block_diffusion_refuses_them(fields):
    process = BlockDiffusion(make_schedule("linear"), VOCAB, 4)
    with pytest.raises(ValueError, match="block diffusion model does not take it"):
        process.sample(_network(), SamplingPlan(**fields), num_samples=1, seq_len=8, window=16)
