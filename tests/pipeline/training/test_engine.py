"""The DeepSpeed engine's plan (``pipeline.training.engine``): the batch arithmetic, the ZeRO
stage that fits, the DeepSpeed config, the memory estimates behind the "auto" micro-batch and
activation checkpointing, the evaluation batch, the optimizer (its weight-decay groups, fused
AdamW) and the model the engine wraps (activation checkpointing and torch.compile under inductor)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from common.errors import UserError
from common.units import GIB
from evaluation.bounds.scoring import CPU_BATCH_SIZE, default_batch_size
from model.absorbing import AbsorbingDiffusion
from model.schedules import make_schedule
from model.spec import build_trainable
from model.transformer import parameter_counts, preset
from pipeline.config import Config, OptimSection, load_config
from pipeline.training.engine import (
    BLOCK_ACTIVATION_WIDTHS,
    BLOCK_FLOAT32_WIDTHS,
    USABLE_MEMORY_SHARE,
    activation_memory_bytes,
    build_optimizer,
    choose_inference_batch,
    choose_micro_batch,
    choose_zero_stage,
    deepspeed_config,
    inference_memory_bytes,
    model_state_bytes,
    plan_batches,
    plan_training,
    prepare_model,
    resolve_activation_checkpointing,
)
from tests.support.small_networks import VOCAB, small_network, token_batch
from tests.support.small_networks import loss_and_ordered_grads as _nelbo_and_grads

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTH = 12
_net = partial(small_network, LENGTH)
_batch = partial(token_batch, 4, LENGTH)

TIMED = {"model.time_conditioning": "true"}  # uniform and learned need t (a config check)


# ------------------------------------------------------------------ batches and ZeRO
def test_batch_plan_derives_accumulation_and_refuses_what_cannot_divide():
    config = load_config(None, {"train.global_batch_size": "64", "train.micro_batch_size": "4"})
    plan = plan_batches(config, 4)
    assert (plan.micro_batch, plan.accumulation) == (4, 4)
    assert plan_batches(load_config(None, {"train.global_batch_size": "64"}), 8).micro_batch == 8
    with pytest.raises(UserError, match=r"train.micro_batch_size = 3 do not divide over 3 ranks: each rank takes 8 "
                                        r"sequences a step, in micro-batches; choose a train.micro_batch_size that "
                                        r"divides 8 \(2 or 4\), or auto$"):
        plan_batches(load_config(None, {"train.global_batch_size": "24", "train.micro_batch_size": "3"}), 3)
    with pytest.raises(UserError, match="does not divide over 3 ranks"):
        plan_batches(load_config(None, {"train.global_batch_size": "64"}), 3)


@pytest.mark.parametrize("micro", ["auto", "2", "8"])
def test_a_global_batch_that_no_micro_batch_spreads_over_the_ranks_is_refused_with_advice_that_works(micro):
    """8 sequences over 3 ranks: no train.micro_batch_size helps (the advice said to set one);
    a multiple of 3 or 2 or 4 ranks does."""
    config = load_config(None, {"train.global_batch_size": "8", "train.micro_batch_size": micro})
    with pytest.raises(UserError, match=r"^config field train.global_batch_size = 8 does not divide over 3 ranks, "
                                        r"whatever train.micro_batch_size is: make it a multiple of 3 \(6 or 9\), or "
                                        r"run 2 or 4 processes$"):
        plan_batches(config, 3)
    assert plan_batches(load_config(None, {"train.global_batch_size": "6"}), 3).micro_batch == 2
    advised = load_config(None, {"train.global_batch_size": "8"})
    assert [plan_batches(advised, ranks).micro_batch for ranks in (2, 4)] == [4, 2]


def test_zero_stage_choice_is_the_lowest_that_fits():
    params = 355_000_000
    assert choose_zero_stage(params, 8, "bf16", 80 * 2**30) == 1
    stage1 = model_state_bytes(params, 1, 8, "bf16")
    stage2 = model_state_bytes(params, 2, 8, "bf16")
    assert stage2 < stage1
    assert choose_zero_stage(params, 8, "bf16", int(stage1 * 1.9)) == 2  # half the memory holds stage 2 only
    assert choose_zero_stage(params, 8, "bf16", 10**6) == 3


def test_deepspeed_config_has_fp32_accumulation_under_bf16():
    config = load_config(None, {"train.global_batch_size": "16", "train.micro_batch_size": "2",
                                "train.zero_stage": "2", "train.precision": "bf16"})
    ds = deepspeed_config(plan_training(config, preset("tiny", 64), 2, torch.device("cpu")), config.optim)
    assert ds["train_batch_size"] == 16 and ds["gradient_accumulation_steps"] == 4
    assert ds["bf16"]["enabled"] and ds["data_types"]["grad_accum_dtype"] == "fp32"
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_clipping"] == 1.0


def test_off_gpu_auto_keeps_the_whole_rank_batch_and_compile_and_attention_resolve():
    config = load_config(None, {"train.global_batch_size": "16"})
    assert (config.train.micro_batch_size, config.train.compile, config.train.attention) == ("auto", "auto", "auto")
    plan = plan_training(config, preset("tiny", 64, vocab_multiple=128), 2, torch.device("cpu"))
    assert (plan.batches.micro_batch, plan.batches.accumulation, plan.compile, plan.attention) == (8, 1, False, "flash")
    assert plan_training(load_config(None, {"train.compile": "true", "train.attention": "math"}), preset("tiny", 64),
                         1, torch.device("cpu")).attention == "math"
    # A single rank has no one to overlap communication with; a bucket is GRADIENT_BUCKET_ELEMENTS.
    zero = deepspeed_config(plan, config.optim)["zero_optimization"]
    assert zero["stage"] == 1 and zero["overlap_comm"] is False and zero["contiguous_gradients"] is True
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 50_000_000
    with pytest.raises(UserError, match=r"train.micro_batch_size = 5: must divide train.global_batch_size = 16"):
        load_config(None, {"train.global_batch_size": "16", "train.micro_batch_size": "5"})


# ------------------------------------------------------------------ memory
MEDIUM = preset("medium", 50257, vocab_multiple=128)


def _medium(**overrides) -> Config:
    return load_config(None, {"model.preset": "medium", "train.global_batch_size": "512",
                              **{k: str(v) for k, v in overrides.items()}})


def _fits(micro: int, memory: float, world: int = 1, checkpointing: bool = False) -> bool:
    states = model_state_bytes(parameter_counts(MEDIUM).total, 1, world, "bf16")
    return states + activation_memory_bytes(MEDIUM, micro, 1024, "bf16", checkpointing=checkpointing) \
        <= USABLE_MEMORY_SHARE * memory


def test_auto_micro_batch_is_the_largest_the_memory_estimate_fits():
    h100, h200 = 80 * GIB, 141 * GIB
    assert choose_micro_batch(_medium(), MEDIUM, 1, 1, "bf16", h100) == (32, False)
    assert choose_micro_batch(_medium(), MEDIUM, 1, 1, "bf16", h200) == (64, False)
    assert choose_micro_batch(_medium(), MEDIUM, 8, 1, "bf16", h100) == (32, False)  # 64 sequences per rank
    # Just below what 32 needs: 16; just above: 32.
    edge = next(memory for memory in range(40 * GIB, 80 * GIB, GIB // 16) if _fits(32, memory))
    assert choose_micro_batch(_medium(), MEDIUM, 1, 1, "bf16", edge) == (32, False)
    assert choose_micro_batch(_medium(), MEDIUM, 1, 1, "bf16", edge - GIB // 16) == (16, False)
    # A divisor of the rank's share of the global batch: 48 sequences and room for about 20 -> 16.
    room_for_20 = next(memory for memory in range(GIB, 80 * GIB, GIB // 16) if _fits(20, memory))
    assert choose_micro_batch(_medium(**{"train.global_batch_size": 48}), MEDIUM, 1, 1, "bf16", room_for_20) \
        == (16, False)
    # Where not one sequence fits without activation checkpointing, "auto" turns it on ...
    tight = next(memory for memory in range(GIB, 80 * GIB, GIB // 16) if _fits(1, memory, checkpointing=True))
    assert not _fits(1, tight)
    micro, checkpointing = choose_micro_batch(_medium(**{"train.activation_checkpointing": "auto"}), MEDIUM, 1, 1,
                                              "bf16", tight)
    assert checkpointing and micro >= 1 and _fits(micro, tight, checkpointing=True)
    # ... which "false" does not (nothing fits: 1), and "true" fits more sequences than without.
    assert choose_micro_batch(_medium(), MEDIUM, 1, 1, "bf16", tight) == (1, False)
    with_checkpointing = choose_micro_batch(_medium(**{"train.activation_checkpointing": "true"}), MEDIUM, 1, 1,
                                            "bf16", h100)
    assert with_checkpointing[1] and with_checkpointing[0] > 32


def test_activation_memory_counts_the_whole_prediction_and_the_draws():
    network, tokens = preset("small", 50257), 8 * 1024
    absorbing = activation_memory_bytes(network, 8, 1024, "bf16")
    uniform = activation_memory_bytes(network, 8, 1024, "bf16", process="uniform")
    learned = activation_memory_bytes(network, 8, 1024, "bf16", process="learned")
    assert uniform - absorbing == tokens * network.vocab_size * (20 - 8)  # the same rows, more kept per logit
    assert learned == 2 * uniform  # two draws of every sequence through the network


def _medium_decision(micro_batch: int, memory_bytes: float, setting: str = "auto", chunk_rows: int = 0) -> bool:
    config = load_config(None, {"train.activation_checkpointing": setting, "train.global_batch_size": "512",
                                "train.micro_batch_size": str(micro_batch),
                                "train.chunked_cross_entropy": str(chunk_rows)})
    return resolve_activation_checkpointing(config, preset("medium", 50257), plan_batches(config, 8), 1, "bf16",
                                            int(memory_bytes))


def test_activation_estimate_follows_its_stated_formula():
    network = preset("medium", 50257)
    tokens, d, v = 16 * 1024, network.d_model, network.vocab_size
    block = tokens * d * (BLOCK_FLOAT32_WIDTHS * 4 + BLOCK_ACTIVATION_WIDTHS * 2)
    head = tokens * d * (4 + 2)
    assert activation_memory_bytes(network, 16, 1024, "bf16") == 24 * block + head + tokens * v * (8 + 2)
    checkpointed = activation_memory_bytes(network, 16, 1024, "bf16", checkpointing=True)
    assert checkpointed == 24 * tokens * d * 2 + block + head + tokens * v * (8 + 2)
    chunked = activation_memory_bytes(network, 16, 1024, "bf16", chunk_rows=4096)
    assert chunked == 24 * block + head + 4096 * v * (8 + 2)
    assert activation_memory_bytes(network, 16, 1024, "fp32") > activation_memory_bytes(network, 16, 1024, "bf16")


def test_auto_checkpointing_turns_on_only_when_activations_do_not_fit_next_to_the_model_states():
    network = preset("medium", 50257)
    states = model_state_bytes(parameter_counts(network).total, 1, 8, "bf16")
    needed = states + activation_memory_bytes(network, 16, 1024, "bf16")
    threshold = needed / USABLE_MEMORY_SHARE
    assert not _medium_decision(16, threshold * 1.01)
    assert _medium_decision(16, threshold * 0.99)
    # On an 80 GiB GPU GPT-2 medium fits micro-batch 16 as is, but not 64.
    assert not _medium_decision(16, 80 * GIB) and _medium_decision(64, 80 * GIB)
    # Chunked cross-entropy frees the logits' share: the same memory then suffices.
    assert not _medium_decision(16, threshold * 0.99, chunk_rows=4096)
    # true and false are decisions already, whatever the memory.
    assert _medium_decision(1, 10**15, setting="true") and not _medium_decision(64, 10**6, setting="false")


def test_the_evaluation_batch_is_sized_to_the_device():
    assert default_batch_size(MEDIUM, 1024, torch.device("cpu")) == CPU_BATCH_SIZE
    batch = choose_inference_batch(MEDIUM, 1024, "bf16", 80 * GIB, 256)
    assert batch & (batch - 1) == 0 and 16 <= batch < 256  # a power of two, the estimate's largest
    assert inference_memory_bytes(MEDIUM, batch, 1024, "bf16") <= USABLE_MEMORY_SHARE * 80 * GIB
    assert inference_memory_bytes(MEDIUM, 2 * batch, 1024, "bf16") > USABLE_MEMORY_SHARE * 80 * GIB
    assert choose_inference_batch(MEDIUM, 1024, "bf16", 10**15, 256) == 256
    assert choose_inference_batch(MEDIUM, 1024, "bf16", GIB, 256) == 1


# ------------------------------------------------------------------ the optimizer
def test_theta_is_optimized_without_weight_decay():
    spec = load_config(None, {"model.process": "learned", **TIMED}).model.spec(preset("tiny", 11, n_layers=1))
    trained = build_trainable(spec)
    groups = build_optimizer(trained, OptimSection(weight_decay=0.1), torch.device("cpu")).param_groups
    theta = trained.schedule.theta
    assert [group["weight_decay"] for group in groups if any(p is theta for p in group["params"])] == [0.0]
    assert sum(len(group["params"]) for group in groups) == len(list(trained.parameters()))


def test_fused_adamw_takes_the_steps_of_the_multi_tensor_path():
    """The fused kernel (on by default on GPU; CPU has one too) updates the weights as the
    default path does, weight-decay groups included."""
    x0 = _batch()
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    optim = load_config(None, {"optim.lr": "1e-2", "optim.weight_decay": "0.1"}).optim
    weights = {}
    for fused in (False, True):
        net = _net()
        optimizer = build_optimizer(net, optim, torch.device("cpu"), fused=fused)
        for seed in range(3):
            net.zero_grad(set_to_none=True)
            diffusion.nelbo(net, x0, generator=torch.Generator().manual_seed(seed)).mean().backward()
            optimizer.step()
        weights[fused] = [p.detach().clone() for p in net.parameters()]
    for fused, reference in zip(weights[True], weights[False], strict=True):
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)
    assert not torch.equal(weights[False][0], _net().embed.weight)  # the steps moved the weights


# ------------------------------------------------------------------ the wrapped model
@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compile_leaves_the_loss_and_parameter_names_unchanged(checkpointing):
    """Inductor on CPU (needs a C compiler; about a minute on two cores)."""
    eager, x0 = _net(), _batch()
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    loss, grads = _nelbo_and_grads(eager, diffusion, x0)
    compiled = _net()
    prepare_model(compiled, checkpointing=checkpointing, compile=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled_loss, compiled_grads = _nelbo_and_grads(compiled, diffusion, x0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # compiled, not silently eager
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=0)
    for grad, reference in zip(compiled_grads, grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-4, atol=1e-6)
    if not checkpointing:  # (checkpointing's wrapper adds its own prefix, which export strips)
        assert list(compiled.state_dict()) == list(eager.state_dict())
