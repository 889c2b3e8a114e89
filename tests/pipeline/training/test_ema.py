"""The exponential moving average of the weights (``pipeline.training.ema``): its decay with
warmup, its fused update, the weights swapped in and back, and a whole EMA cut into the ZeRO-3
partition of any rank."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from pipeline.run_dir.rank_files import full_state
from pipeline.training.ema import EMA, ema_decay
from tests.support.small_networks import small_network

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTH = 64
_net = partial(small_network, LENGTH)


def test_ema_follows_the_formula_with_warmup():
    assert ema_decay(0.9999, 0, True) == pytest.approx(0.1)
    assert ema_decay(0.9999, 90, True) == pytest.approx(91 / 100)
    assert ema_decay(0.9999, 10**9, True) == 0.9999 and ema_decay(0.5, 0, False) == 0.5
    layer = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    ema = EMA(layer, 0.5, warmup=False)
    with torch.no_grad():
        layer.weight.fill_(3.0)
    ema.update()
    assert torch.equal(ema.shadow["weight"], torch.full((1, 2), 2.0))
    with ema.applied():
        assert torch.equal(layer.weight, torch.full((1, 2), 2.0))
    assert torch.equal(layer.weight, torch.full((1, 2), 3.0))  # the live weights come back
    restored = EMA(layer, 0.5, warmup=False)
    restored.load_state_dict(ema.state_dict())
    assert torch.equal(restored.shadow["weight"], ema.shadow["weight"]) and restored.updates == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_ema_update_is_the_per_parameter_lerp(dtype):
    net = _net().to(dtype)
    ema = EMA(net, 0.99, warmup=True)
    reference = {name: p.detach().float().clone() for name, p in net.named_parameters()}
    for update in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        weight = 1.0 - ema_decay(0.99, update, True)
        reference = {name: torch.lerp(reference[name], p.detach().float(), weight)
                     for name, p in net.named_parameters()}
    for name, value in reference.items():
        assert torch.equal(ema.shadow[name], value), name


@pytest.mark.parametrize("rank,expected", [(0, [0.0, 1, 2]), (1, [3.0, 4, 5]), (2, [6.0, 0, 0])])
def test_a_whole_ema_is_cut_into_the_zero3_partition_of_any_rank(monkeypatch, rank, expected):
    """Resuming on 3 ranks an EMA written by 2: whole tensors (full_state) are cut as ZeRO-3
    cuts parameters, flat and zero-padded to a multiple of the world size."""
    layer = nn.Linear(1, 7, bias=False)
    layer.weight.ds_tensor, layer.weight.ds_shape = torch.zeros(3), torch.Size([7, 1])  # ZeRO-3 on 3 ranks
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank)
    ema = EMA(layer, 0.9)
    ema.load_full_state(full_state([{"partitioned": True, "shapes": {"weight": [7, 1]}, "shadow": {"weight": s}}
                                    for s in (torch.tensor([0.0, 1, 2, 3]), torch.tensor([4.0, 5, 6, 0]))]), 12)
    assert torch.equal(ema.shadow["weight"], torch.tensor(expected)) and ema.updates == 12
    with pytest.raises(ValueError, match="has shape"):
        ema.load_full_state({"weight": torch.zeros(6, 1)}, 12)
