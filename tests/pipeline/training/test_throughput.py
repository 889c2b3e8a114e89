"""Model FLOPs (``pipeline.training.throughput``): per token by the stated formula, and a
forward's FLOPs counting the head only where logits are computed."""

from __future__ import annotations

import pytest

from model.transformer import Transformer, preset
from pipeline.training.throughput import flops_per_token

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_flops_per_token_follows_the_stated_formula():
    n = sum(p.numel() for p in Transformer(preset("tiny", 50257)).parameters())
    assert flops_per_token(preset("tiny", 50257), 256) == 6 * n + 12 * 4 * 256 * 256
    medium = flops_per_token(preset("medium", 50257), 1024)
    assert 6 * 350e6 < medium < 6 * 360e6 + 12 * 24 * 1024 * 1024  # GPT-2 medium: about 355M parameters


def test_forward_flops_count_the_head_only_where_logits_are_computed():
    from pipeline.training.throughput import flops_per_token, forward_flops

    config = preset("small", 50257)
    full = forward_flops(config, 1024, tokens=1000, head_rows=1000)   # every row: the forward convention,
    # less the embedding's mask row, which N counts and the head never computes
    assert full == pytest.approx(1000 * (flops_per_token(config, 1024) / 3 - 2 * 768), rel=1e-12)
    half = forward_flops(config, 1024, tokens=1000, head_rows=500)
    assert full - half == pytest.approx(500 * 2 * 768 * 50257)
