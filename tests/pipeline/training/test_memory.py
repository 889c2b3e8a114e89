"""The memory estimate before the first step (``pipeline.training.memory``): its activations
against the bytes torch allocates on CPU for tiny shapes, its model states against what a real
DeepSpeed engine and the EMA allocate, the large and xl presets fitting one 80 GB or 141 GB GPU
by default, and the one-line refusal of a run that cannot fit."""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

from common.errors import UserError
from common.units import GIB
from model.transformer import Block, Transformer, parameter_counts, preset
from pipeline.config import load_config
from pipeline.distributed import init_distributed
from pipeline.training.ema import EMA
from pipeline.training.engine import (
    USABLE_MEMORY_SHARE,
    activation_memory_bytes,
    build_engine,
    choose_micro_batch,
    choose_zero_stage,
    model_state_parts,
    plan_training,
)
from pipeline.training.memory import check_memory, estimate_memory, rank_memory_bytes
from tests.support.allocations import allocations_of
from tests.support.cli_refusals import one_line_error
from tests.support.cli_runner import DISTRIBUTED_ENV
from tests.support.paths import REPO

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (layers, d_model, heads, micro-batch, sequence length, vocabulary): activations dominate the
# weights (a block's transient weight gradient is far below its activations), and the second
# makes the loss's logits the larger part.
SHAPES = [(3, 64, 2, 8, 128, 211), (2, 64, 2, 8, 64, 2000)]


def _measured_activations(shape: tuple, precision: str, checkpointing: bool) -> int:
    """Peak bytes torch allocates on CPU for one eager forward and backward of the loss at every
    position, the gradients already allocated by an earlier step (as in training)."""
    layers, width, heads, micro, length, vocab = shape
    network = Transformer(preset("tiny", vocab, n_layers=layers, d_model=width, n_heads=heads, max_seq_len=length,
                                 vocab_multiple=1)).to(DTYPES[precision])
    if checkpointing:
        apply_activation_checkpointing(network, check_fn=lambda module: isinstance(module, Block))
    masked = torch.full((micro, length), vocab)
    every_position = torch.ones(micro, length, dtype=torch.bool)
    targets = torch.randint(0, vocab, (micro * length,), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        network.nll_at(masked, None, every_position, targets).sum().backward()

    step()
    return allocations_of(step).peak


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["kept", "checkpointed"])
@pytest.mark.parametrize("shape", SHAPES, ids=["blocks", "logits"])
def test_the_activation_estimate_is_what_torch_allocates_on_cpu(shape, precision, checkpointing):
    layers, width, heads, micro, length, vocab = shape
    network = preset("tiny", vocab, n_layers=layers, d_model=width, n_heads=heads, max_seq_len=length,
                     vocab_multiple=1)
    estimate = activation_memory_bytes(network, micro, length, precision, checkpointing=checkpointing,
                                       compiled=False)
    measured = _measured_activations(shape, precision, checkpointing)
    # Within a few percent, and never far below: a refusal or an "auto" choice rests on it.
    assert 0.97 * measured <= estimate <= 1.08 * measured, (estimate, measured)


@pytest.fixture
def world_of_one(monkeypatch):
    for name in DISTRIBUTED_ENV:
        monkeypatch.delenv(name, raising=False)
    group = init_distributed()
    yield group
    group.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_states_are_what_a_deepspeed_engine_and_the_ema_allocate(world_of_one, precision):
    """ZeRO-1 on one CPU rank: the weights, fp32 gradients and optimizer states (Adam's moments,
    and fp32 master weights under bf16) a DeepSpeed engine holds after a step, and the EMA."""
    config = load_config(None, {"train.global_batch_size": "2", "train.zero_stage": "1",
                                "train.precision": precision})
    network = preset("tiny", 997, n_layers=2, d_model=128, n_heads=2, max_seq_len=16, vocab_multiple=1)
    plan = plan_training(config, network, 1, world_of_one.device)
    tokens = torch.randint(0, 997, (2, 16), generator=torch.Generator().manual_seed(0))
    engine = None

    def build_and_step() -> None:
        nonlocal engine
        engine = build_engine(Transformer(network), plan, config.optim, 10, world_of_one.device)
        loss = engine(tokens).float().logsumexp(-1).mean()
        engine.backward(loss)
        engine.step()

    parts = model_state_parts(parameter_counts(network).total, 1, 1, precision)
    held = allocations_of(build_and_step).live
    assert held == pytest.approx(parts["weights"] + parts["gradients"] + parts["optimizer"], rel=0.01)
    assert allocations_of(lambda: setattr(engine, "ema", EMA(engine.module, 0.9))).live == parts["ema"]


GPUS = {"80 GB": 80 * GIB, "141 GB": 141 * GIB}


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("name, micro_batches", [("large", (16, 32)), ("xl", (8, 16))])
def test_large_and_xl_fit_one_80_or_141_gb_gpu_by_default(name, micro_batches, gpu):
    """What "auto" picks for the shipped configs on one GPU with GPT-2's vocabulary: ZeRO-1,
    no activation checkpointing, and the largest micro-batch whose estimate fits."""
    config = load_config(REPO / "configs" / f"{name}.yaml")
    network = preset(name, 50257, vocab_multiple=config.model.vocab_multiple)
    memory = GPUS[gpu]
    parameters = parameter_counts(network).total
    stage = choose_zero_stage(parameters, 1, "bf16", memory)
    micro, checkpointing = choose_micro_batch(config, network, 1, stage, "bf16", memory)
    assert (stage, micro, checkpointing) == (1, micro_batches[gpu == "141 GB"], False)
    states = sum(model_state_parts(parameters, stage, 1, "bf16").values())
    fits = states + activation_memory_bytes(network, micro, 1024, "bf16")
    assert fits <= USABLE_MEMORY_SHARE * memory < states + activation_memory_bytes(network, 2 * micro, 1024, "bf16")


def test_a_run_that_cannot_fit_is_refused_in_one_line_with_the_numbers():
    config = load_config(REPO / "configs" / "xl.yaml", {"train.micro_batch_size": "64", "train.precision": "bf16",
                                                        "train.zero_stage": "1", "train.activation_checkpointing": "false"})
    network = preset("xl", 50257, vocab_multiple=128)
    plan = plan_training(config, network, 1, torch.device("cpu"))
    estimate = estimate_memory(config, network, plan)
    with pytest.raises(UserError) as refusal:
        check_memory(estimate, plan, network, 80 * GIB)
    message = str(refusal.value)
    assert "\n" not in message and f"= {estimate.total / GIB:.1f} GiB per rank (micro-batch 64 x 1024 tokens" in message
    assert "weights 2.9 + gradients 5.8 + optimizer states 17.4 + EMA 5.8 + activations" in message
    assert "ZeRO-1 over 1 rank(s), bf16) and a rank has 80.0 GiB: lower train.micro_batch_size" in message
    check_memory(estimate, plan, network, int(estimate.total) + 1)  # all of the memory may be used


def test_on_cpu_the_ranks_of_a_host_share_its_memory(monkeypatch):
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert rank_memory_bytes(torch.device("cpu")) == host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert rank_memory_bytes(torch.device("cpu")) == host // 4


def test_train_refuses_on_cpu_a_run_the_host_cannot_hold_before_its_first_step(capsys, tinyshakespeare_shards,
                                                                               tmp_path):
    err = one_line_error(capsys, "train", "--config", str(REPO / "configs" / "xl.yaml"),
                         "--data", str(tinyshakespeare_shards), "--run-dir", str(tmp_path / "run"),
                         "--train.global_batch_size", "4096", "--train.micro_batch_size", "4096",
                         "--logging.mlflow", "false")
    assert "this run needs an estimated" in err and "micro-batch 4096 x 64 tokens" in err
    assert "and a rank has" in err and "lower train.micro_batch_size" in err
