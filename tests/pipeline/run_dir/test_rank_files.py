"""The rank files of a checkpoint (``pipeline.run_dir.rank_files``): the RNG states that restore
every generator, and the EMA's ZeRO-3 partitions reassembled into whole tensors."""

from __future__ import annotations

import torch

from pipeline.run_dir.rank_files import full_state, rng_state, set_rng_state
from pipeline.run_dir.safe_load import load_torch_file


def test_the_rng_states_of_a_rank_file_restore_every_generator(tmp_path):
    import random

    import numpy as np

    torch.save({"rng": rng_state()}, tmp_path / "rank-00000.pt")
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(load_torch_file(tmp_path / "rank-00000.pt")["rng"])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], again[0]) and (drawn[1] == again[1]).all() and drawn[2] == again[2]


def test_full_state_reassembles_padded_zero3_partitions():
    weight = torch.arange(7.0).view(7, 1)  # 7 elements over 2 ranks: slices of 4, the last padded
    slices = [torch.tensor([0.0, 1, 2, 3]), torch.tensor([4.0, 5, 6, 0])]
    states = [{"partitioned": True, "shapes": {"w": [7, 1]}, "shadow": {"w": s}} for s in slices]
    assert torch.equal(full_state(states)["w"], weight)
    replicated = [{"partitioned": False, "shapes": {"w": [7, 1]}, "shadow": {"w": weight}}]
    assert torch.equal(full_state(replicated)["w"], weight)
