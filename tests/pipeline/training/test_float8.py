"""FP8 training (``pipeline.training.float8``): refused in one line where it cannot run (CPU, a GPU
below compute capability 8.9, no torchao, blocks not compiled), the layers it converts, and, where
torchao is installed (the fp8 extra), a converted network that keeps its parameters and gives the
loss of the bf16 one within FP8's rounding. The GPU's speed and loss curve: tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from common.errors import UserError
from model.transformer import Transformer, preset
from pipeline.config import load_config
from pipeline.training.engine import plan_training, prepare_model
from pipeline.training.float8 import FLOAT8_LAYERS, convert_to_float8, float8_layer, float8_refusal
from tests.support.cli_refusals import one_line_error

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GPU = torch.device("cuda", 0)


def test_fp8_is_refused_on_cpu_before_any_work():
    config = load_config(None, {"train.float8": "true", "train.global_batch_size": "4"})
    with pytest.raises(UserError, match=r"^config field train.float8 = true: FP8 matmuls need a CUDA GPU of compute "
                                        r"capability 8.9 or higher \(Ada, Hopper or later\), and this run is on the "
                                        r"CPU; set train.float8 false$"):
        plan_training(config, preset("tiny", 97), 1, torch.device("cpu"))
    assert not plan_training(load_config(None, {"train.global_batch_size": "4"}), preset("tiny", 97), 1,
                             torch.device("cpu")).float8


def test_fp8_is_refused_below_compute_capability_8_9_without_torchao_and_uncompiled():
    assert "and cuda:0 has 8.0; set train.float8 false" in float8_refusal(GPU, (8, 0), True, True)  # A100
    assert "pip install 'unmask[fp8]'" in float8_refusal(GPU, (9, 0), False, True)
    assert "needs the blocks compiled" in float8_refusal(GPU, (9, 0), True, False)
    assert float8_refusal(GPU, (8, 9), True, True) is None and float8_refusal(GPU, (10, 0), True, True) is None


def test_train_refuses_fp8_on_cpu_in_one_line(capsys, tinyshakespeare_shards, tmp_path):
    err = one_line_error(capsys, "train", "--data", str(tinyshakespeare_shards),
                         "--run-dir", str(tmp_path / "run"), "--train.float8", "true", "--logging.mlflow", "false")
    assert err.endswith("train.float8 = true: FP8 matmuls need a CUDA GPU of compute capability 8.9 or higher "
                        "(Ada, Hopper or later), and this run is on the CPU; set train.float8 false")


def test_fp8_converts_each_block_s_four_projections_only():
    network = Transformer(preset("tiny", 97, n_layers=2, d_model=64, n_heads=2, time_conditioning=True,
                                 tie_weights=False))
    converted = sorted(name for name, module in network.named_modules() if float8_layer(module, name))
    assert converted == sorted(f"blocks.{i}.{layer}" for i in range(2) for layer in FLOAT8_LAYERS)
    # Projections whose width FP8 tiles (16) do not divide stay as they are.
    odd = Transformer(preset("tiny", 97, n_layers=1, d_model=40, n_heads=2))
    assert not any(float8_layer(module, name) for name, module in odd.named_modules())


def test_a_converted_network_keeps_its_parameters_and_gives_the_bf16_loss_within_fp8_rounding():
    pytest.importorskip("torchao", reason="torchao is not installed: pip install 'unmask[fp8]'")
    torch.manual_seed(0)
    network = Transformer(preset("tiny", 97, n_layers=2, d_model=64, n_heads=2, max_seq_len=32)).to(torch.bfloat16)
    z = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(1))
    every_position = torch.ones(4, 32, dtype=torch.bool)
    targets = torch.randint(0, 97, (4 * 32,), generator=torch.Generator().manual_seed(2))
    state = {name: tensor.clone() for name, tensor in network.state_dict().items()}
    reference = network.nll_at(z, None, every_position, targets).float().mean()
    assert convert_to_float8(network) == 2 * len(FLOAT8_LAYERS)
    assert all(type(network.get_submodule(f"blocks.0.{layer}")).__name__ == "Float8Linear" for layer in FLOAT8_LAYERS)
    after = network.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[name], state[name]) for name in state)
    loss = network.nll_at(z, None, every_position, targets).float().mean()
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - reference.item()) < 0.02 * reference.item()
    assert network.blocks[0].attn.qkv.weight.grad is not None


def test_prepare_model_converts_before_it_wraps_and_compiles():
    pytest.importorskip("torchao", reason="torchao is not installed: pip install 'unmask[fp8]'")
    network = Transformer(preset("tiny", 97, n_layers=1, d_model=64, n_heads=2, max_seq_len=32))
    prepare_model(network, checkpointing=True, compile=False, float8=True)
    assert sum(type(module).__name__ == "Float8Linear" for module in network.modules()) == len(FLOAT8_LAYERS)
