"""Block diffusion (BD3-LM): the vectorized forward, its masks, and the bound (docs/math.md#block-diffusion).

The vectorized training forward over [z ; x] must equal a naive loop that runs each block
with its clean prefix; FlexAttention's BlockMask must be the dense mask entry for entry (tile
size included); block size L must be today's MDLM estimate; and with exact conditionals the
bound must equal -log p(x) for block sizes 1, 2 and L.
"""

import math
import warnings

import pytest
import torch

from model.absorbing import AbsorbingDiffusion
from model.block_attention import (
    FLEX_TILE,
    AttentionLayout,
    block_causal_mask,
    dense_block_mask,
    flex_block_mask,
)
from model.block_diffusion import BlockDiffusion, block_times, spread_over_blocks
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig

VOCAB, LENGTH = 3, 4
ORACLE_SIZE = (VOCAB, LENGTH)  # the conftest's `oracle` fixture
Z_LIMIT = 4.0  # |estimate - truth| / standard error; deterministic seeds


def _network(length: int = 16, vocab: int = 11, **overrides) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=vocab, n_layers=2, d_model=32, n_heads=4, max_seq_len=length, **overrides)
    return Transformer(config).double().eval()


def _naive_block_logits(network: Transformer, z: torch.Tensor, x0: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each block b alone: a forward of (x0^<b, z^b), block-causal, positions 0..end-1."""
    out = []
    for start in range(0, z.shape[1], block_size):
        end = start + block_size
        sequence = torch.cat([x0[:, :start], z[:, start:end]], dim=1)
        layout = AttentionLayout(positions=None, mask=block_causal_mask(end, block_size))
        out.append(network(sequence, layout=layout)[:, start:end])
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_vectorized_logits_equal_the_naive_block_loop(block_size):
    network = _network()
    generator = torch.Generator().manual_seed(1)
    x0 = torch.randint(0, 11, (3, 16), generator=generator)
    z = torch.where(torch.rand(3, 16, generator=generator) < 0.5, 11, x0)
    vectorized = network(z, clean=x0, block_size=block_size)
    naive = _naive_block_logits(network, z, x0, block_size)
    torch.testing.assert_close(vectorized, naive, rtol=0, atol=1e-10)
    # and the prediction of block b really does not see the clean copy of block b or later
    changed = x0.clone()
    changed[:, block_size:] = (changed[:, block_size:] + 1) % 11
    first = network(z, clean=changed, block_size=block_size)[:, :block_size]
    torch.testing.assert_close(first, vectorized[:, :block_size], rtol=0, atol=1e-12)


def test_dense_mask_is_the_rule_of_the_paper():
    mask = dense_block_mask(4, 2)
    noisy_noisy, noisy_clean = mask[:4, :4], mask[:4, 4:]
    clean_noisy, clean_clean = mask[4:, :4], mask[4:, 4:]
    block_diagonal = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(noisy_noisy, block_diagonal)
    assert torch.equal(noisy_clean, torch.tensor([[0, 0, 0, 0]] * 2 + [[1, 1, 0, 0]] * 2, dtype=torch.bool))
    assert not clean_noisy.any()
    assert torch.equal(clean_clean, block_causal_mask(4, 2))


def _flex_pattern(block_mask, rows: int) -> torch.Tensor:
    """Which keys each query attends through FlexAttention with ``block_mask``: equal scores
    (q = k = 0) and one-hot values, so the output row is uniform over the attended keys."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.zeros(1, 1, rows, 16, dtype=torch.float64)
    values = torch.eye(rows, dtype=torch.float64)[None, None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": the CPU reference path
        out = flex_attention(q, q, values, block_mask=block_mask)
    return out[0, 0] > 0


@pytest.mark.parametrize("length,block_size", [(16, 4), (100, 4), (192, 16), (160, 1)])
def test_flex_block_mask_equals_the_dense_mask_entry_for_entry(length, block_size):
    """2L = 32 (one partial tile), 200 (tiles of 128 cut mid-block), 384, 320 (block size 1)."""
    dense = dense_block_mask(length, block_size)
    block_mask = flex_block_mask(length, block_size, "cpu")
    assert block_mask.BLOCK_SIZE == (FLEX_TILE, FLEX_TILE)
    assert torch.equal(_flex_pattern(block_mask, 2 * length), dense)


def test_flex_and_dense_forwards_agree():
    network = _network(length=32)
    x0 = torch.randint(0, 11, (2, 32), generator=torch.Generator().manual_seed(3))
    z = torch.where(torch.arange(32) % 3 == 0, 11, x0)
    dense = network(z, clean=x0, block_size=8)
    network.block_attention = "flex"
    with warnings.catch_warnings(), torch.no_grad():  # FlexAttention has no backward on CPU
        warnings.simplefilter("ignore")
        flex = network(z, clean=x0, block_size=8)
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-10)


def test_block_size_length_is_todays_mdlm_estimate():
    network = _network(length=16)
    schedule = make_schedule("linear")
    x0 = torch.randint(0, 11, (6, 16), generator=torch.Generator().manual_seed(4))
    t = torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mdlm = AbsorbingDiffusion(schedule, 11).nelbo_terms(network, x0, t, torch.Generator().manual_seed(6))
    block = BlockDiffusion(schedule, 11, 16).nelbo_terms(network, x0, t, torch.Generator().manual_seed(6))
    assert torch.equal(block.num_masked, mdlm.num_masked)  # the same masks, draw for draw
    for name in ("diffusion", "reconstruction", "prior"):
        torch.testing.assert_close(getattr(block, name), getattr(mdlm, name), rtol=0, atol=1e-10)


def test_block_times_are_stratified_over_the_global_batch():
    whole = block_times(8, 4, torch.Generator().manual_seed(0))
    parts = torch.cat([block_times(2, 4, torch.Generator().manual_seed(0), offset=o, global_batch_size=8)
                       for o in range(0, 8, 2)])
    assert torch.equal(whole, parts)
    assert torch.allclose(whole.flatten().sort().values.diff(), torch.full((31,), 1 / 32, dtype=torch.float64))
    spread = spread_over_blocks(torch.tensor([0.9], dtype=torch.float64), 4)
    torch.testing.assert_close(spread, torch.tensor([[0.9, 0.15, 0.4, 0.65]], dtype=torch.float64))


# ------------------------------------------------------------------ the bound, against exact conditionals
@pytest.mark.parametrize("block_size", [1, 2, LENGTH])
def test_monte_carlo_block_nelbo_matches_minus_log_likelihood(oracle, block_size):
    """E[NELBO] = -log p(x) within its standard error (the endpoint guard's terms are < 4 eps L log V)."""
    schedule = make_schedule("linear")
    process = BlockDiffusion(schedule, VOCAB, block_size)
    order = oracle.probs.argsort(descending=True)
    sequences = oracle.sequences[order[[0, 3, 20, 70]]]
    repeats = 6_000
    batch = sequences.repeat(repeats, 1)
    estimates = process.nelbo(oracle, batch, generator=torch.Generator().manual_seed(7)).view(repeats, -1)
    mean, standard_error = estimates.mean(0), estimates.std(0) / math.sqrt(repeats)
    truth = -oracle.log_prob(sequences)
    endpoint = 4 * schedule.endpoint_eps * LENGTH * math.log(VOCAB)
    assert ((mean - truth).abs() / (standard_error + endpoint)).max() < Z_LIMIT


# ------------------------------------------------------------------ training
def _objective_and_network(mask_rate=(0.0, 1.0)):
    from model.spec import ModelSpec
    from pipeline.training.objective import make_objective

    network = _network(length=16)
    spec = ModelSpec(network=network.config, block_size=4)
    return make_objective(spec, validate=True, block_mask_rate=mask_rate), network


def test_the_training_loss_is_the_block_bound_at_the_slots_times():
    from pipeline.training.objective import MicroBatchSlot, row_generators, step_generator

    objective, network = _objective_and_network()
    x0 = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(8))
    slot = MicroBatchSlot(seed=3, step=5, rank=1, world_size=2, micro=1, micro_batches=2)
    loss = objective.loss_sum(network, x0, slot)
    # the slots (micro 1, rank 1) of the global batch of 8 rows x 4 blocks, one uniform per step
    times = block_times(2, 4, step_generator(torch.device("cpu"), 3, 5), offset=6, global_batch_size=8)
    process = BlockDiffusion(make_schedule("linear"), 11, 4)
    expected = process.nelbo(network, x0, times, row_generators(torch.device("cpu"), slot, 2),
                             reconstruction="uniform").sum()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


@torch.no_grad()
def test_mask_rate_clipping_is_for_training_only():
    """The clipped objective is what the trainer trains on; it validates on the bound unclipped
    (``TrainingParts.bound``), whatever the network's mode."""
    from pipeline.training.objective import FULL_MASK_RATE, MicroBatchSlot

    x0 = torch.randint(0, 11, (8, 16), generator=torch.Generator().manual_seed(9))
    slot = MicroBatchSlot(seed=0, step=1, rank=0, world_size=1, micro=0, micro_batches=1)
    clipped, network = _objective_and_network(mask_rate=(0.45, 0.95))
    full, _ = _objective_and_network()
    times = clipped._block_times(x0, slot)
    rates = clipped.diffusion.schedule.masking_rate(times)
    assert rates.min() >= 0.45 - 1e-9 and rates.max() <= 0.95 + 1e-9
    for mode in (network.train, network.eval):  # no dropout: the mode changes nothing in the network itself
        mode()
        assert float(clipped.loss_sum(network, x0, slot)) != float(full.loss_sum(network, x0, slot))
    assert float(clipped.clipped(FULL_MASK_RATE).loss_sum(network, x0, slot)) == float(full.loss_sum(network, x0, slot))


def test_block_diffusion_is_refused_where_the_math_is_not_carried_over():
    from common.errors import UserError
    from pipeline.config import load_config

    for overrides, word in [({"model.process": "uniform", "model.time_conditioning": "true", "model.block_size": "4"},
                             "uniform"),
                            ({"model.process": "learned", "model.time_conditioning": "true",
                              "model.block_size": "4"}, "learned"),
                            ({"model.block_size": "4", "model.time_conditioning": "true"}, "time-free"),
                            ({"train.block_mask_rate": "[0.3, 0.8]"}, "set model.block_size")]:
        with pytest.raises(UserError, match=rf"config field (model\.block_size|train\.block_mask_rate) .*{word}"):
            load_config(None, overrides)
    assert load_config(None, {"model.block_size": "4"}).model.block_size == 4


@pytest.mark.slow
def test_a_block_diffusion_run_trains_and_its_export_reproduces_validation(tmp_path, tinyshakespeare_shards):
    """A real run (DeepSpeed on CPU) with block size 16, clipped training rates and their
    interval search: the export records the block size, and its process scores the validation
    batches to the logged number (the full bound: validation ignores the clipping)."""
    import json

    from data_prep.shards.loader import StreamingLoader
    from pipeline.interchange.export import export, load_export
    from pipeline.training.objective import MicroBatchSlot, make_objective
    from tests.support.train_helpers import run_train, write_config

    config = write_config(tmp_path / "c.yaml", {"model": {"block_size": 16},
                                                "train": {"block_mask_rate": [0.3, 0.8], "max_steps": 3,
                                                          "block_mask_rate_search": True}})
    run = run_train(tmp_path / "run", tinyshakespeare_shards, config)
    assert all(math.isfinite(v) for v in run.losses().values())
    # the interval search ran at both validations, and the checkpoint keeps its last choice
    searched = {m["step"]: (m["val/block_mask_rate_beta"], m["val/block_mask_rate_omega"])
                for m in run.metrics() if "val/block_mask_rate_beta" in m}
    assert sorted(searched) == [0, 3] and all(beta < omega for beta, omega in searched.values())
    state = json.loads((run.run_dir / "checkpoints" / "step-00000003" / "unmask_state.json").read_text())
    assert tuple(state["block_mask_rate"]) == searched[3]
    exported = load_export(export(run.run_dir))
    assert exported.config["block_size"] == 16 and exported.spec.block_size == 16
    objective = make_objective(exported.spec, validate=True)
    loader = StreamingLoader(tinyshakespeare_shards, "val", 2, seed=1234, shuffle=False)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i, batch in zip(range(2), loader):
            slot = MicroBatchSlot(seed=1234, step=i, rank=0, world_size=1, micro=0, micro_batches=1)
            total += float(objective.loss_sum(exported.network, batch, slot))
            tokens += batch.numel()
    assert total / tokens == pytest.approx(run.validations()[3], rel=1e-6)


# ------------------------------------------------------------------ evaluation
@pytest.mark.parametrize("block_size", [1, 2, LENGTH])
def test_the_zero_shot_estimator_reports_the_full_block_bound(oracle, block_size):
    """``estimate_bound`` with the block process and exact conditionals: the reported bound is
    -log p(x) per token within its standard error (plus the endpoint guard's few 1e-4)."""
    from evaluation.bounds.estimator import Blocks, estimate_bound

    order = oracle.probs.argsort(descending=True)
    tokens = oracle.sequences[order[[0, 3, 20, 70, 5, 1]]]
    blocks = Blocks(tokens, torch.ones_like(tokens, dtype=torch.bool))
    schedule = make_schedule("linear")
    process = BlockDiffusion(schedule, VOCAB, block_size)
    estimate = estimate_bound(process, oracle, blocks, samples_per_block=1000, batch_size=64, seed=1)
    truth = float(-oracle.log_prob(tokens).sum()) / blocks.num_tokens
    endpoint = 2 * schedule.endpoint_eps * math.log(VOCAB)
    assert abs(estimate.nelbo_per_token - truth) < Z_LIMIT * estimate.standard_error + endpoint
    assert estimate.standard_error < 0.05 * truth  # the test can tell a wrong conditioning apart


# ------------------------------------------------------------------ sampling
from model.sampling import SamplingPlan, sample_generators  # noqa: E402

SAMPLERS = [SamplingPlan(sampler="ancestral", steps=8), SamplingPlan(sampler="first-hitting"),
            SamplingPlan(sampler="confidence", steps=4), SamplingPlan(sampler="remdm", steps=8)]


def _sampling_network(dtype=torch.float32) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=11, n_layers=2, d_model=32, n_heads=4, max_seq_len=32)
    return Transformer(config).to(dtype).eval()


@pytest.mark.parametrize("plan", SAMPLERS, ids=lambda plan: plan.sampler)
def test_cached_samples_are_the_uncached_ones_bit_for_bit(plan):
    network = _sampling_network()
    process = BlockDiffusion(make_schedule("linear"), 11, 4)
    prompt = torch.full((24,), 11)
    prompt[:3] = torch.tensor([1, 2, 3])  # a prefix that ends inside the first block
    kwargs = dict(num_samples=3, seq_len=24, prompt=prompt, window=32)
    cached, stats = process.sample(network, plan, **kwargs)
    uncached, _ = process.sample(network, plan, kv_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:, :3], prompt[:3].expand(3, -1)) and int(cached.max()) < 11
    assert stats.network_calls > 0


def test_the_cache_gives_the_recomputed_logits_and_a_block_sees_only_the_blocks_before_it():
    """float64: the cached network outputs equal the recomputed ones to 1e-12."""
    network = _sampling_network(torch.float64)
    from model.block_attention import KVCache
    from model.sampling.blocks import BlockNetwork

    x = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(0))
    block = torch.where(torch.tensor([True, False, True, False]), 11, x[:, 8:12])
    cached = BlockNetwork(network, 4)
    cached.cache, cached.prefix = KVCache(), x[:, :0]
    for start in (0, 4):
        cached.append(x[:, start:start + 4], None)
    uncached = BlockNetwork(network, 4)
    uncached.prefix = x[:, :8]
    torch.testing.assert_close(cached.logits(block, None), uncached.logits(block, None), rtol=0, atol=1e-12)
    # and it is the training forward's output at that block
    training = network(torch.cat([x[:, :8], block], 1), clean=x, block_size=4)[:, 8:]
    torch.testing.assert_close(cached.logits(block, None), training, rtol=0, atol=1e-12)


def test_samples_do_not_depend_on_the_batch():
    network, process = _sampling_network(), BlockDiffusion(make_schedule("linear"), 11, 4)
    plan = SamplingPlan(sampler="ancestral", steps=6, seed=3)
    together, _ = process.sample(network, plan, num_samples=4, seq_len=16, window=32)
    alone, _ = process.sample(network, plan, num_samples=1, seq_len=16, window=32,
                              generator=sample_generators(3, [2]))
    assert torch.equal(together[2:3], alone)


def test_generation_runs_past_the_training_context_with_a_sliding_window():
    network, process = _sampling_network(), BlockDiffusion(make_schedule("linear"), 11, 4)
    plan = SamplingPlan(sampler="first-hitting", seed=1)
    tokens, _ = process.sample(network, plan, num_samples=2, seq_len=80, window=32)  # 2.5 windows
    assert tokens.shape == (2, 80) and int(tokens.max()) < 11
    # while it fits in the window, it is the sample of a shorter request (blocks are left to right)
    short, _ = process.sample(network, plan, num_samples=2, seq_len=32, window=32)
    assert torch.equal(tokens[:, :32], short)


def test_generation_stops_at_eos():
    network, process = _sampling_network(), BlockDiffusion(make_schedule("linear"), 11, 4)
    eos = 5
    plan = SamplingPlan(sampler="ancestral", steps=4, seed=0, until_eos=eos)
    tokens, _ = process.sample(network, plan, num_samples=6, seq_len=64, window=32)
    free, _ = process.sample(network, SamplingPlan(sampler="ancestral", steps=4, seed=0), num_samples=6,
                             seq_len=64, window=32)
    for row, unstopped in zip(tokens, free):
        hits = (unstopped == eos).nonzero()
        if len(hits):  # the same sample up to the block of its first EOS, then EOS only
            end = (int(hits[0]) // 4 + 1) * 4
            assert torch.equal(row[:end], unstopped[:end]) and bool((row[end:] == eos).all())
        else:
            assert torch.equal(row, unstopped)
    with pytest.raises(ValueError, match="until_eos stops a block diffusion"):
        AbsorbingDiffusion(make_schedule("linear"), 11).sample(network, plan, num_samples=1, seq_len=8)


# ------------------------------------------------------------------ lm-eval's loglikelihood
@pytest.mark.parametrize("block_size", [1, 2])
def test_continuations_are_scored_by_the_block_factorization(oracle, block_size):
    """log p(c | x) of a block model: continuation blocks given the clean context blocks. With
    exact conditionals the estimate is the table's log p(c | x) within its standard error; a
    context that leaves a partial block is preceded by EOS (here token 0, scored by the table
    as the first token of the row: the truth is log p(c | 0, x))."""
    from evaluation.downstream.likelihoods import ScoringModel, ScoringSettings, score_continuations

    process = BlockDiffusion(make_schedule("linear"), VOCAB, block_size)
    model = ScoringModel(process, oracle, LENGTH, pad_id=0)
    order = oracle.probs.argsort(descending=True)
    x = oracle.sequences[order[[0, 7]]]
    def log_conditional(row: torch.Tensor, given: int) -> float:
        match = (oracle.sequences[:, :given] == row[:given]).all(-1)
        return float(oracle.log_prob(row[None])[0] - oracle.probs[match].sum().log())

    pairs, truths = [(x[0, :2].tolist(), x[0, 2:].tolist())], [log_conditional(x[0], 2)]
    if block_size == 1:  # a context of one token, a continuation of three
        pairs.append((x[1, :1].tolist(), x[1, 1:].tolist()))
        truths.append(log_conditional(x[1], 1))
    else:  # a context of one token and two to continue: one EOS (0) first to fill the blocks
        pairs.append((x[1, 1:2].tolist(), x[1, 2:].tolist()))
        truths.append(log_conditional(torch.cat([torch.tensor([0]), x[1, 1:]]), 2))
    scores = score_continuations(model, pairs, ScoringSettings(samples=3000, seed=0, batch_rows=512))
    for score, truth in zip(scores, truths):
        assert abs(score.log_likelihood - truth) < Z_LIMIT * score.standard_error + 1e-3
        assert score.standard_error < 0.1 * abs(truth)


# ------------------------------------------------------------------ commands
@pytest.fixture(scope="module")
def block_export(tmp_path_factory, tinyshakespeare_shards):
    """An untrained block diffusion export (blocks of 8, max_seq_len 64) over the shards' tokenizer."""
    from data_prep.tokenizer.load import load_tokenizer
    from tests.support.export_fixtures import write_untrained_export

    tokenizer_dir = tinyshakespeare_shards / "tokenizer"
    return write_untrained_export(tmp_path_factory.mktemp("bd3") / "export", load_tokenizer(tokenizer_dir),
                                  tokenizer_dir, config={"block_size": 8}, max_seq_len=64)


def test_unmask_sample_generates_past_the_context_and_stops_at_eos(block_export, tmp_path):
    import json

    from tests.support.cli_runner import unmask_in_process

    out = tmp_path / "samples.jsonl"
    assert unmask_in_process(["sample", str(block_export), "--num", "3", "--sampler", "first-hitting",
                              "--seq-len", "150", "--until-eos", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(record["tokens"]) for record in records] == [150] * 3  # past max_seq_len 64
    assert all(record["plan"]["until_eos"] is not None for record in records)
    # a block export samples in its own blocks: another --block-len is refused in one line
    assert unmask_in_process(["sample", str(block_export), "--num", "1", "--block-len", "4"]) == 2


def test_unmask_export_format_hf_writes_a_block_export_with_its_block_size(block_export, tmp_path):
    """The transformers directory records the block size its modeling file runs the block forward at
    (its logits: tests/pipeline/interchange/test_hf_export.py)."""
    import json

    from tests.support.cli_runner import unmask_in_process

    out = tmp_path / "hf"
    assert unmask_in_process(["export", str(block_export), "--format", "hf", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["block_size"] == config["unmask"]["block_size"] == 8


def test_complete_continues_prompts_of_any_length_with_the_block_sampler(block_export):
    from evaluation.generation.generate import complete
    from pipeline.interchange.export import load_export

    exported = load_export(block_export)
    plan = SamplingPlan(sampler="ancestral", steps=4)
    prompts = ["ROMEO:", "First Citizen: we are"]
    samples = complete(exported, plan, prompts, max_new_tokens=70)  # past max_seq_len 64, not whole blocks
    for prompt, sample in zip(prompts, samples):
        encoded = exported.tokenizer.encode(prompt)
        assert len(sample.tokens) == len(encoded) + 70 and sample.tokens[:len(encoded)] == encoded


@pytest.mark.slow
def test_unmask_eval_reports_the_block_bound_and_names_the_block_size(block_export, tinyshakespeare_shards,
                                                                       tmp_path, mlflow_server):
    import json

    from mlflow import MlflowClient

    from tests.support.cli_runner import unmask_in_process

    out = tmp_path / "report"
    assert unmask_in_process(["eval", str(block_export), "--datasets", "val", "--shards", str(tinyshakespeare_shards),
                              "--max-documents", "10", "--samples", "2", "--batch-size", "8", "--num-samples", "2",
                              "--sample-steps", "4", "--mlflow-uri", mlflow_server, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["protocol"]["block_size"] == 8 and "blocks of 8 tokens" in results["protocol"]["bound"]
    assert math.isfinite(results["datasets"]["val"]["nelbo_per_token"])
    assert len(results["samples"]) == 2  # drawn by the block sampler
    assert "block_size" in (out / "report.md").read_text()
    tags = MlflowClient(mlflow_server).get_run(results["mlflow"]["run_id"]).data.tags
    assert tags["eval/block_size"] == "8"


def test_an_evaluation_length_that_cuts_a_block_is_refused_in_one_line(block_export, tinyshakespeare_shards, capsys):
    from tests.support.cli_runner import unmask_in_process

    assert unmask_in_process(["eval", str(block_export), "--datasets", "val", "--shards", str(tinyshakespeare_shards),
                              "--seq-len", "60", "--out", "unused"]) == 2
    assert "--seq-len 60: the model is a block diffusion over blocks of 8 tokens" in capsys.readouterr().err


def test_block_diffusion_flops_count_the_clean_half_without_its_head():
    from pipeline.training.throughput import block_diffusion_flops_per_token, flops_per_token

    config = TransformerConfig(vocab_size=1000, n_layers=2, d_model=64, n_heads=4, max_seq_len=128)
    mdlm = flops_per_token(config, 128)
    attention_per_key = 12 * 2 * 64
    head = 1000 * 64
    n = (mdlm - attention_per_key * 128) / 6
    assert block_diffusion_flops_per_token(config, 128, 16) == 6 * n + 6 * (n - head) + attention_per_key * (128 + 32)


@torch.no_grad()
def test_the_interval_search_picks_the_least_variance_of_the_clipped_loss():
    from pipeline.training.mask_rate_search import interval_variances, least_variance
    from pipeline.training.objective import MicroBatchSlot, row_generators

    objective, network = _objective_and_network()
    batches = [torch.randint(0, 11, (6, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    candidates = ((0.0, 1.0), (0.3, 0.8), (0.45, 0.95))
    records = interval_variances(objective, network, batches, 5, 0, 1, list, candidates)
    assert [r.interval for r in records] == list(candidates) and all(r.sequences == 12 for r in records)
    # the clipped loss of (0.3, 0.8) by hand: the same slots, times clipped, per sequence per token
    clipped, _ = _objective_and_network(mask_rate=(0.3, 0.8))
    values = []
    for i, x0 in enumerate(batches):
        slot = MicroBatchSlot(seed=5, step=i, rank=0, world_size=1, micro=0, micro_batches=1)
        times = clipped._block_times(x0, slot)
        values.append(clipped.diffusion.nelbo(network, x0, times, row_generators(x0.device, slot, 6),
                                              reconstruction="uniform") / 16)
    values = torch.cat(values)
    assert records[1].mean == pytest.approx(float(values.mean()), rel=1e-9)
    assert records[1].variance == pytest.approx(float(values.var()), rel=1e-6)
    assert least_variance(records) == min(records, key=lambda r: r.variance)
    assert records[0].variance > min(r.variance for r in records[1:])  # clipping 1/t's tail lowers it
