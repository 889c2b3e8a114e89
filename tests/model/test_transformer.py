"""The denoiser network: attention direction, time conditioning, presets, bf16, learning."""

import math

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.autoregressive import Autoregressive
from model.block_attention import AttentionLayout, KVCache
from model.schedules import make_schedule
from model.transformer import (
    PRESETS,
    FamilyLayers,
    Transformer,
    TransformerConfig,
    count_parameters,
    parameter_counts,
    preset,
)

VOCAB, LENGTH = 13, 10


def _net(**overrides) -> Transformer:
    config = TransformerConfig(vocab_size=VOCAB, n_layers=2, d_model=32, n_heads=4,
                               max_seq_len=LENGTH, **overrides)
    net = Transformer(config).eval()
    for p in net.parameters():  # away from adaLN-zero's identity start
        torch.nn.init.normal_(p, std=0.1)
    return net


def _tokens(batch=3):
    return torch.randint(0, VOCAB + 1, (batch, LENGTH), generator=torch.Generator().manual_seed(0))


def _changed_at(position: int, z: torch.Tensor) -> torch.Tensor:
    other = z.clone()
    other[:, position] = (other[:, position] + 1) % (VOCAB + 1)
    return other


def test_bidirectional_outputs_depend_on_later_positions():
    net, z = _net(), _tokens()
    with torch.no_grad():
        delta = (net(z) - net(_changed_at(LENGTH - 1, z))).abs()
    assert bool((delta[:, 0].amax(-1) > 1e-4).all())


def test_causal_outputs_ignore_later_positions():
    net, z = _net(causal=True), _tokens()
    with torch.no_grad():
        base = net(z)
        later = net(_changed_at(6, z))
        earlier = net(_changed_at(2, z))
    torch.testing.assert_close(base[:, :6], later[:, :6], rtol=0, atol=1e-6)
    assert bool(((base[:, 6:] - later[:, 6:]).abs().amax((1, 2)) > 1e-4).all())
    assert bool(((base[:, 2:] - earlier[:, 2:]).abs().amax((1, 2)) > 1e-4).all())



@pytest.mark.parametrize("family", [None, FamilyLayers(learned_positions=LENGTH + 1, norm_bias=True, qkv_bias=True),
                                    FamilyLayers(norm="rmsnorm", mlp="swiglu", kv_heads=2)],
                         ids=["unmask", "gpt2-layers", "llama-layers"])
def test_a_causal_network_decoding_one_row_at_a_time_after_its_kv_cache_gives_its_full_forward(family):
    """Autoregressive decoding (evaluation.generation): the first rows on an empty cache, then one
    new row per call against the cached keys and values; each call's outputs are the full causal
    forward's at those positions (rotary or learned positions, grouped-query heads)."""
    net, z = _net(causal=True, family=family), _tokens()
    cache = KVCache(append=True)
    layout = AttentionLayout(positions=None, mask=None, cache=cache)
    with torch.no_grad():
        full = net(z)
        first = net(z[:, :4], layout=layout)
        steps = [net(z[:, i:i + 1], layout=layout) for i in range(4, LENGTH)]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full, rtol=0, atol=1e-5)
    assert cache.length == LENGTH
    again = AttentionLayout(positions=None, mask=None, cache=KVCache(append=True))
    with torch.no_grad(), pytest.raises(ValueError, match="one new row at a time"):
        net(z[:, :2], layout=again)
        net(z[:, 2:4], layout=again)   # a causal mask would align these rows with the first two keys


def test_time_conditioning():
    z = _tokens()
    t1, t2 = torch.full((3,), 0.2), torch.full((3,), 0.7)
    conditioned, free = _net(time_conditioning=True), _net()
    with torch.no_grad():
        assert float((conditioned(z, t1) - conditioned(z, t2)).abs().max()) > 1e-4
        torch.testing.assert_close(free(z, t1), free(z, t2), rtol=0, atol=0)
        torch.testing.assert_close(free(z, None), free(z, t1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="pass t"):
        conditioned(z, None)


def test_adaln_zero_starts_every_block_as_identity():
    net = Transformer(TransformerConfig(vocab_size=VOCAB, n_layers=2, d_model=32, n_heads=4,
                                        max_seq_len=LENGTH, time_conditioning=True))
    z = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(net(z, torch.full((3,), 0.1)), net(z, torch.full((3,), 0.9)))


def test_output_mask_selects_positions():
    net, z = _net(time_conditioning=True), _tokens()
    t = torch.tensor([0.1, 0.5, 0.9])
    mask = z == VOCAB
    with torch.no_grad():
        torch.testing.assert_close(net(z, t, output_mask=mask), net(z, t)[mask], rtol=1e-5, atol=1e-5)


def test_tied_head_shares_the_embedding_and_never_predicts_the_mask():
    tied, untied = _net(), _net(tie_weights=False)
    assert tied(_tokens()).shape == (3, LENGTH, VOCAB)
    assert untied(_tokens()).shape == (3, LENGTH, VOCAB)
    names = {name for name, _ in tied.named_parameters()}
    assert "head.weight" not in names and "head.weight" in {n for n, _ in untied.named_parameters()}


def test_dropout_is_active_only_in_training():
    net, z = _net(dropout=0.3), _tokens()
    with torch.no_grad():
        torch.testing.assert_close(net(z), net(z), rtol=0, atol=0)
        net.train()
        assert float((net(z) - net(z)).abs().max()) > 1e-4


def test_bf16_forward_is_finite_and_close_to_float32():
    net, z = _net(time_conditioning=True), _tokens()
    t = torch.tensor([0.1, 0.5, 0.9])
    with torch.no_grad():
        reference = net(z, t)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = net(z, t)
        weights_bf16 = net.to(torch.bfloat16)(z, t)
    for out in (autocast, weights_bf16):
        assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
        assert float((out.float() - reference).abs().max()) < 0.05 * float(reference.abs().max())


def test_sequence_longer_than_max_seq_len_is_refused():
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        _net()(torch.zeros(1, LENGTH + 1, dtype=torch.long))


@pytest.mark.parametrize("field,value,match", [
    ("n_heads", 5, "n_heads"), ("dropout", 1.0, "dropout"), ("vocab_size", 1, "vocab_size"),
    ("causal", True, "causal"), ("time_input", "t", "time_input"), ("rope_angles", "float16", "rope_angles"),
    ("time_frequencies", 1, "time_frequencies"), ("head_bias", True, "untied head"),
    ("head_mask_row", True, "untied head"),
])
def test_config_validation(field, value, match):
    kwargs = dict(vocab_size=VOCAB, d_model=32, n_heads=4, time_conditioning=True)
    kwargs[field] = value
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        preset("huge", VOCAB)


GPT2_VOCAB = 50257


def test_preset_shapes_and_parameter_counts():
    """Non-embedding = layers * (12 d^2 + 2 d) + d; total adds the (V + 1) x d embedding."""
    shapes = {"small": (12, 768, 12), "medium": (24, 1024, 16)}
    for name, (layers, width, heads) in shapes.items():
        config = preset(name, GPT2_VOCAB)
        assert (config.n_layers, config.d_model, config.n_heads) == (layers, width, heads)
        expected = layers * (12 * width**2 + 2 * width) + width
        counts = parameter_counts(config)
        assert counts.non_embedding == expected
        assert counts.total == expected + (GPT2_VOCAB + 1) * width
    assert round(parameter_counts(preset("small", GPT2_VOCAB)).non_embedding / 1e6, 1) == 85.0
    assert round(parameter_counts(preset("medium", GPT2_VOCAB)).non_embedding / 1e6, 1) == 302.0
    assert round(parameter_counts(preset("large", GPT2_VOCAB)).non_embedding / 1e6, 1) == 707.9
    assert round(parameter_counts(preset("xl", GPT2_VOCAB)).non_embedding / 1e6, 1) == 1474.7


MDLM_OPTIONS = {"tie_weights": False, "mlp_bias": True, "head_bias": True, "head_mask_row": True,
                "adaptive_norm": True, "time_frequencies": 256, "time_input": "loglinear_sigma",
                "rope_angles": "float32"}


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("options", [{}, {"time_conditioning": True, "tie_weights": False}, MDLM_OPTIONS,
                                     {**MDLM_OPTIONS, "time_conditioning": True, "time_embed_dim": 129}])
def test_counted_parameters_match_the_formula(name, options):
    config = preset(name, GPT2_VOCAB, **options)
    with torch.device("meta"):  # no memory, no initialisation
        model = Transformer(config)
    assert count_parameters(model) == parameter_counts(config)


# ------------------------------------------------------------------ options for exact imports
def test_the_default_network_keeps_its_parameters():
    """Exports written before the import options existed load into the default network."""
    names = {name: tuple(p.shape) for name, p in _net().state_dict().items()}
    block = {"attn_norm.weight": (32,), "attn.qkv.weight": (96, 32), "attn.out.weight": (32, 32),
             "mlp_norm.weight": (32,), "mlp.up.weight": (128, 32), "mlp.down.weight": (32, 128)}
    expected = {"embed.weight": (VOCAB + 1, 32), "final_norm.weight": (32,),
                **{f"blocks.{i}.{name}": shape for i in range(2) for name, shape in block.items()}}
    assert names == expected


def test_float32_rotary_angles_are_mdlm_s_and_differ_from_float64_at_long_range():
    from model.transformer import RotaryEmbedding

    head_dim, length = 64, 1024
    mdlm = RotaryEmbedding(head_dim, length, 10_000.0, "float32")
    inv_freq = 1.0 / (10_000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.einsum("i,j->ij", torch.arange(length).float(), inv_freq)
    assert torch.equal(mdlm.cos, angles.cos()) and torch.equal(mdlm.sin, angles.sin())
    exact = RotaryEmbedding(head_dim, length, 10_000.0)
    assert float((exact.cos - mdlm.cos).abs().max()) > 1e-5


def test_the_mask_row_of_the_head_is_never_used():
    net = _net(tie_weights=False, head_bias=True, head_mask_row=True)
    assert net.head.weight.shape == (VOCAB + 1, 32) and net.head.bias.shape == (VOCAB + 1,)
    z = _tokens()
    with torch.no_grad():
        before = net(z)
        net.head.weight[VOCAB].fill_(1e3)
        net.head.bias[VOCAB] = 1e3
        torch.testing.assert_close(net(z), before, rtol=0, atol=0)
    assert before.shape == (3, LENGTH, VOCAB)


def test_adaptive_norm_without_time_conditioning_is_a_learned_constant():
    net, z = _net(adaptive_norm=True), _tokens()
    assert net.time_independent and all(block.modulation is not None for block in net.blocks)
    with torch.no_grad():
        torch.testing.assert_close(net(z, None), net(z, torch.full((3,), 0.7)), rtol=0, atol=0)
        modulated = net(z)
        for block in net.blocks:
            block.modulation.bias.zero_()
        assert float((net(z) - modulated).abs().max()) > 1e-4  # the constant does modulate


def test_the_loglinear_sigma_time_input_is_mdlm_s_total_noise():
    from model.transformer import _time_input

    t = torch.tensor([0.0, 0.5, 1.0])
    torch.testing.assert_close(_time_input(t, "loglinear_sigma"), -torch.log(1 - (1 - 1e-3) * t))
    assert torch.equal(_time_input(t, "scaled_t"), 1000 * t)


# ------------------------------------------------------------------------- learning
MARKOV_VOCAB, MARKOV_LENGTH, STAY_ON_PATTERN = 8, 8, 0.9


def _markov_sequences(num: int, generator: torch.Generator) -> torch.Tensor:
    """x_0 uniform; x_{n+1} = x_n + 1 (mod V) with prob 0.9, else uniform."""
    x = torch.empty(num, MARKOV_LENGTH, dtype=torch.long)
    x[:, 0] = torch.randint(0, MARKOV_VOCAB, (num,), generator=generator)
    for n in range(1, MARKOV_LENGTH):
        follow = torch.rand(num, generator=generator) < STAY_ON_PATTERN
        jump = torch.randint(0, MARKOV_VOCAB, (num,), generator=generator)
        x[:, n] = torch.where(follow, (x[:, n - 1] + 1) % MARKOV_VOCAB, jump)
    return x


def _markov_entropy() -> float:
    p_next = STAY_ON_PATTERN + (1 - STAY_ON_PATTERN) / MARKOV_VOCAB
    p_other = (1 - STAY_ON_PATTERN) / MARKOV_VOCAB
    step = -(p_next * math.log(p_next) + (MARKOV_VOCAB - 1) * p_other * math.log(p_other))
    return math.log(MARKOV_VOCAB) + (MARKOV_LENGTH - 1) * step


def _train(loss_fn, causal: bool, steps: int, lr: float) -> Transformer:
    torch.manual_seed(0)
    net = Transformer(TransformerConfig(vocab_size=MARKOV_VOCAB, n_layers=2, d_model=64, n_heads=4,
                                        max_seq_len=MARKOV_LENGTH, causal=causal))
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = loss_fn(net, _markov_sequences(256, generator), generator).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return net.eval()


def _mean_and_error(values: torch.Tensor) -> tuple[float, float]:
    return float(values.mean()), float(values.std() / math.sqrt(values.numel()))


@pytest.mark.slow
def test_diffusion_training_drives_the_bound_to_the_entropy():
    diffusion = AbsorbingDiffusion(make_schedule("linear"), MARKOV_VOCAB)
    entropy = _markov_entropy()
    held_out = _markov_sequences(4096, torch.Generator().manual_seed(2))

    def bound(net):
        with torch.no_grad():
            return _mean_and_error(diffusion.nelbo(net, held_out, generator=torch.Generator().manual_seed(3)))

    untrained, _ = bound(_net_like_markov())
    trained, error = bound(_train(lambda net, x, g: diffusion.nelbo(net, x, generator=g,
                                                                    reconstruction="uniform"),
                                  causal=False, steps=250, lr=5e-3))
    assert trained > entropy - 4 * error, "a valid bound cannot go below the entropy"
    assert trained < 1.2 * entropy
    assert (trained - entropy) < 0.1 * (untrained - entropy)


@pytest.mark.slow
def test_autoregressive_baseline_reaches_the_entropy():
    objective = Autoregressive(MARKOV_VOCAB)
    entropy = _markov_entropy()
    net = _train(lambda net, x, g: objective.nll(net, x), causal=True, steps=150, lr=5e-3)
    with torch.no_grad():
        nll, error = _mean_and_error(objective.nll(net, _markov_sequences(4096, torch.Generator().manual_seed(2))))
    assert entropy - 4 * error < nll < 1.05 * entropy


def _net_like_markov() -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(vocab_size=MARKOV_VOCAB, n_layers=2, d_model=64, n_heads=4,
                                         max_seq_len=MARKOV_LENGTH)).eval()
