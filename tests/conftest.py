"""Shared test helpers."""

import pytest
import torch

from model.oracle import EnumerableDistribution


class ConstantDenoiser:
    """Predicts the same distribution at every position; counts its calls and times."""

    def __init__(self, probs: torch.Tensor) -> None:
        self.logits = probs.log().float()
        self.calls: list[torch.Tensor] = []

    def __call__(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.calls.append(t.clone())
        return self.logits.expand(*z.shape, -1).clone()


@pytest.fixture
def small_oracle() -> EnumerableDistribution:
    return EnumerableDistribution.random(3, 4, torch.Generator().manual_seed(0))
