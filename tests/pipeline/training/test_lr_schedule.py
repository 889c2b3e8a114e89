"""The learning rate schedule (``pipeline.training.lr_schedule``): linear warmup, then constant
or cosine decay to its floor."""

from __future__ import annotations

import pytest

from pipeline.config import OptimSection
from pipeline.training.lr_schedule import lr_multiplier


def test_lr_warms_up_linearly_then_follows_the_decay():
    constant = OptimSection(warmup_steps=10, decay="constant")
    assert [lr_multiplier(s, constant, 100) for s in (0, 4, 9, 10, 99)] == [0.1, 0.5, 1.0, 1.0, 1.0]
    cosine = OptimSection(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(10, cosine, 110) == pytest.approx(1.0)
    assert lr_multiplier(60, cosine, 110) == pytest.approx(0.55)
    assert lr_multiplier(110, cosine, 110) == pytest.approx(0.1)
    assert lr_multiplier(500, cosine, 110) == pytest.approx(0.1)
