"""Reading torch files without running code from them (``pipeline.run_dir.safe_load``): a
payload is refused by name and never runs, a rank file's own state loads, and a truncated file
is named as truncated. The same through export, eval and resume: ``test_checkpoint.py``."""

from __future__ import annotations

import pytest
import torch

from pipeline.run_dir.rank_files import rng_state
from pipeline.run_dir.safe_load import UnsafeOrCorruptFile, load_torch_file
from tests.support.mdlm_reference import Payload as _Payload


def test_a_payload_is_refused_by_name_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "rank-00000.pt"
    torch.save({"ema": _Payload(marker)}, path)
    with pytest.raises(UnsafeOrCorruptFile, match=r"rank-00000.pt: refused: loading it would call posix.system"):
        load_torch_file(path)
    assert not marker.exists()


def test_a_rank_files_state_loads_and_numpys_own_rng_state_is_refused(tmp_path):
    """A rank file holds tensors and plain values, its RNG states included (``rng_state``);
    numpy's own state pickles numpy's constructors, which an unmask file never holds."""
    import numpy as np

    path = tmp_path / "state.pt"
    torch.save({"shadow": {"w": torch.arange(3.0)}, "rng": rng_state(), "python": (3, (1, 2), None)}, path)
    loaded = load_torch_file(path)
    assert torch.equal(loaded["shadow"]["w"], torch.arange(3.0))
    torch.save({"rng": {"numpy": np.random.get_state()}}, path)
    with pytest.raises(UnsafeOrCorruptFile, match=r"state.pt: refused: loading it would call numpy"):
        load_torch_file(path)


def test_a_truncated_file_is_named_as_truncated(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"w": torch.zeros(1000)}, path)
    path.write_bytes(path.read_bytes()[:1500])
    with pytest.raises(UnsafeOrCorruptFile, match=r"x.pt: truncated or corrupt"):
        load_torch_file(path)
