"""The inert unpickler: tensors come back exactly, everything else becomes a record, and no
callable the file names ever runs."""

from __future__ import annotations

import builtins
import os
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from pipeline.interchange.inert_pickle import InertArchive, InertObject, TensorRef
from tests.support.mdlm_reference import Payload


class Record:
    """A class of this test module: unknown to the unpickler, as a library's class would be."""

    def __init__(self, value: int) -> None:
        self.value = value


class EvalPayload:
    """Pickles as builtins.exec of code that writes a file."""

    def __init__(self, marker: Path) -> None:
        self.code = f"open({str(marker)!r}, 'w').write('ran')"

    def __reduce__(self):
        return builtins.exec, (self.code,)


def test_tensors_come_back_exactly_with_their_dtypes_views_and_parameters(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    tensors = {
        "float": torch.randn(3, 4, generator=g), "double": torch.randn(2, dtype=torch.float64, generator=g),
        "bf16": torch.randn(7, generator=g).bfloat16(), "half": torch.randn(2, 2, generator=g).half(),
        "long": torch.arange(5), "bool": torch.tensor([True, False]), "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3), "view": base[1:4, 2:], "transposed": base.t(),
        "parameter": torch.nn.Parameter(torch.randn(2, 3, generator=g)),
    }
    torch.save({"state": OrderedDict(tensors), "step": 7}, tmp_path / "t.ckpt")
    with InertArchive(tmp_path / "t.ckpt") as archive:
        root = archive.root()
        assert isinstance(root["state"], OrderedDict) and list(root["state"]) == list(tensors)
        assert root["step"] == 7
        for name, tensor in tensors.items():
            ref = root["state"][name]
            assert isinstance(ref, TensorRef), name
            loaded = archive.tensor(ref)
            assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape, name
            assert torch.equal(loaded, tensor.detach()), name


def test_unknown_classes_become_records_of_their_state(tmp_path):
    torch.save({"config": Record(12), "classes": {1, 2}}, tmp_path / "r.ckpt")
    with InertArchive(tmp_path / "r.ckpt") as archive:
        root = archive.root()
    record = root["config"]
    assert isinstance(record, InertObject) and not isinstance(record, Record)
    assert record.origin == f"{__name__}.Record" and record.state == {"value": 12}
    assert root["classes"] == {1, 2}


@pytest.mark.parametrize("payload", [Payload, EvalPayload])
def test_a_reduce_payload_never_runs(tmp_path, payload):
    marker = tmp_path / "pwned"
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": payload(marker)}, tmp_path / "p.ckpt")
    with InertArchive(tmp_path / "p.ckpt") as archive:
        root = archive.root()
        assert torch.equal(archive.tensor(root["state_dict"]["w"]), torch.ones(2))
    call = root["hyper_parameters"]
    assert isinstance(call, InertObject) and call.origin in ("posix.system", "__builtin__.exec")
    assert call.args == (payload(marker).__reduce__()[1][0],)  # recorded, not called
    assert not marker.exists(), "the payload ran"
    assert os.path.exists(tmp_path / "p.ckpt")


def _rewrite(path: Path, edit) -> None:
    """Rewrite the zip ``path`` with ``edit(name, data) -> data`` applied to every record."""
    with zipfile.ZipFile(path) as source:
        records = [(info, edit(info.filename, source.read(info))) for info in source.infolist()]
    with zipfile.ZipFile(path, "w") as target:
        for info, data in records:
            target.writestr(info, data)


def test_a_tensor_is_read_only_when_asked_for_and_a_short_storage_is_refused(tmp_path):
    path = tmp_path / "s.ckpt"
    torch.save({"weights": torch.ones(4), "optimizer": torch.zeros(1000)}, path)
    _rewrite(path, lambda name, data: data[:8] if name.endswith("/data/1") else data)  # cut the optimizer's
    with InertArchive(path) as archive:
        root = archive.root()
        assert torch.equal(archive.tensor(root["weights"]), torch.ones(4))
        short = r"s\.ckpt: storage record .*data/1 has 8 bytes, its pickle declares 1000 x 4"
        with pytest.raises(UserError, match=short):
            archive.tensor(root["optimizer"])


def test_files_that_are_not_torch_archives_are_refused_naming_them(tmp_path):
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    with pytest.raises(UserError, match=r"text\.ckpt: not a readable zip archive .*: truncated, or not written by"):
        InertArchive(tmp_path / "text.ckpt")
    path = tmp_path / "malformed.ckpt"
    torch.save({"w": torch.ones(2)}, path)
    _rewrite(path, lambda name, data: b"\x80\x02garbage" if name.endswith("data.pkl") else data)
    with InertArchive(path) as archive, pytest.raises(UserError, match=r"malformed\.ckpt: truncated or malformed"):
        archive.root()
