"""Block diffusion in training (``pipeline.training``): the objective is the block bound at the
slots' times, clipped mask rates are for training only and their interval search picks the
least variance, FLOPs count the clean half, the config refuses what the math does not carry
over, and a real run's export reproduces its validation. The process itself:
tests/model/test_block_diffusion.py."""

import math

import pytest
import torch

from model.block_diffusion import BlockDiffusion, block_times
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig


def _network(length: int = 16, vocab: int = 11, **overrides) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=vocab, n_layers=2, d_model=32, n_heads=4, max_seq_len=length, **overrides)
    return Transformer(config).double().eval()


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


def test_an_attention_mask_for_blocks_without_blocks_is_refused():
    """``train.block_attention`` chooses block diffusion's mask: set without ``model.block_size`` it
    would change nothing."""
    from common.errors import UserError
    from pipeline.config import load_config

    for form in ("flex", "dense"):
        with pytest.raises(UserError, match=rf"config field train.block_attention = '{form}': chooses block "
                                            r"diffusion's attention mask, and without blocks there is none: set "
                                            r"model.block_size, or leave it auto"):
            load_config(None, {"train.block_attention": form})
    config = load_config(None, {"train.block_attention": "dense", "model.block_size": "4"})
    assert config.train.block_attention == "dense"


def test_masking_rates_that_leave_most_training_sequences_unmasked_are_refused():
    """[0, 1e-9] masks 3e-8 tokens of a sequence of 64 on average: the loss is near 0 and the run
    learns nothing. The clipped intervals must mask at least one token per sequence on average."""
    from common.errors import UserError
    from pipeline.config import load_config
    from pipeline.training.build import check_masked_tokens

    tiny = load_config(None, {"model.block_size": "16", "train.block_mask_rate": "[0, 1e-9]"})
    with pytest.raises(UserError, match=r"config field train.block_mask_rate = \[0.0, 1e-09\]: masks \(beta \+ omega\) "
                                        r"/ 2 = 5e-10 of the tokens on average, 3.2e-08 of a sequence of 64, so most "
                                        r"training sequences have no masked token to learn from; widen it"):
        check_masked_tokens(tiny, 64)
    check_masked_tokens(load_config(None, {"model.block_size": "16", "train.block_mask_rate": "[0.3, 0.8]"}), 64)
    check_masked_tokens(load_config(None, {"model.block_size": "1", "train.block_mask_rate": "[0, 0.05]"}), 64)


def test_a_block_size_that_does_not_divide_the_network_s_window_is_refused(tinyshakespeare_shards):
    """As the exports are checked: the block size divides the window (model.max_seq_len), not
    only the data's sequence length, or sampling and scoring at the window would cut a block."""
    from common.errors import UserError
    from data_prep.shards.format import Manifest
    from pipeline.config import ModelSection
    from pipeline.training.build import network_config

    manifest = Manifest.read(tinyshakespeare_shards)  # sequences of 64
    with pytest.raises(UserError, match=r"config field model.block_size = 64 does not divide model.max_seq_len = 96, "
                                        r"the network's window"):
        network_config(ModelSection(block_size=64, max_seq_len=96), manifest)
    assert network_config(ModelSection(block_size=32, max_seq_len=96), manifest).max_seq_len == 96


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
