"""Checkpoints a user received: nothing in them runs code, and a broken one is named.

A real 6-step run (DeepSpeed on CPU, checkpoints at steps 3 and 6) is copied for each test
and altered as a malicious author (a ``__reduce__`` payload, with the recorded hashes
updated to match) or a bad disk (truncated or flipped bytes) would leave it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from pipeline.interchange.export import export
from pipeline.run_dir.checkpoint import (
    STATE_FILE,
    CheckpointMeta,
    EarlierCheckpoint,
    TrainState,
    _file_records,
    intact_checkpoint,
    read_state,
    resolve_checkpoint,
    verify_checkpoint,
)
from pipeline.run_dir.rank_files import rng_state, set_rng_state
from pipeline.run_dir.safe_load import UnsafeOrCorruptFile, load_torch_file
from tests.support.cli_runner import run_unmask
from tests.support.train_helpers import run_train, write_config

LAST = "step-00000006"
EARLIER = "step-00000003"


class _Payload:
    """Pickles as a call to os.system: what a booby-trapped checkpoint carries."""

    def __init__(self, marker: Path) -> None:
        self.command = f"touch {marker}"

    def __reduce__(self):
        return os.system, (self.command,)


def _plant(path: Path, marker: Path, *, rehash: bool) -> None:
    """Replace a checkpoint file with one whose unpickling runs ``touch marker``."""
    state = {"ema": _Payload(marker), "rng": {}, "module": _Payload(marker)}
    torch.save(state, path)
    if rehash:  # the author also updates the recorded sizes and hashes
        record = path.parent / STATE_FILE
        saved = json.loads(record.read_text())
        saved["files"] = _file_records(path.parent)
        record.write_text(json.dumps(saved))


@pytest.fixture(scope="module")
def shards(tinyshakespeare_shards):
    return tinyshakespeare_shards


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("config") / "micro.yaml")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shards, config):
    """An untouched 6-step run; tests alter copies of it."""
    return run_train(tmp_path_factory.mktemp("trained") / "run", shards, config)


@pytest.fixture
def run_copy(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained.run_dir, copy)  # it tracks into the original's MLflow run (shared store)
    return copy


# ----------------------------------------------------------------------------- unit
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


def test_the_rng_states_of_a_rank_file_restore_every_generator(tmp_path):
    import random

    import numpy as np

    torch.save({"rng": rng_state()}, tmp_path / "rank-00000.pt")
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(load_torch_file(tmp_path / "rank-00000.pt")["rng"])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], again[0]) and (drawn[1] == again[1]).all() and drawn[2] == again[2]


def test_a_state_file_of_an_earlier_unmask_is_refused_in_one_line(tmp_path):
    record = json.loads(CheckpointMeta(state=TrainState(), config={}, config_sha256="c", data_sha256="d",
                                       tokenizer_sha256="t", network={}, zero_stage=1, precision="fp32",
                                       batch_plan={}, world_size=1).to_json())
    path = tmp_path / "step-00000003" / STATE_FILE
    path.parent.mkdir()
    path.write_text(json.dumps(record))
    assert read_state(path.parent).files == {} and verify_checkpoint(path.parent) is None
    del record["files"]  # checkpoints recorded no files before their integrity was checked
    path.write_text(json.dumps(record))
    with pytest.raises(EarlierCheckpoint, match=rf"^{path}: written by an earlier unmask \(no files\); train again "
                                                r"in a new --run-dir$"):
        verify_checkpoint(path.parent)


def test_a_truncated_file_is_named_as_truncated(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"w": torch.zeros(1000)}, path)
    path.write_bytes(path.read_bytes()[:1500])
    with pytest.raises(UnsafeOrCorruptFile, match=r"x.pt: truncated or corrupt"):
        load_torch_file(path)


# ----------------------------------------------------------------------------- security
@pytest.mark.slow
def test_a_payload_in_the_ema_file_runs_neither_on_export_nor_eval_nor_resume(run_copy, shards, config, tmp_path):
    marker = tmp_path / "pwned"
    _plant(run_copy / "checkpoints" / LAST / "rank-00000.pt", marker, rehash=True)
    assert verify_checkpoint(run_copy / "checkpoints" / LAST) is None  # the hashes match: only safe loading helps

    with pytest.raises(UserError, match=r"rank-00000.pt: refused: loading it would call posix.system"):
        export(run_copy)
    evaluated = run_unmask(["eval", str(run_copy), "--datasets", "val", "--shards", str(shards), "--samples", "2"])
    assert evaluated.returncode != 0 and "rank-00000.pt: refused" in evaluated.stderr, evaluated.stderr[-2000:]
    resumed = run_train(run_copy, shards, write_config(tmp_path / "c8.yaml", {"train": {"max_steps": 8}}),
                        check=False)
    assert resumed.returncode != 0 and "rank-00000.pt: refused: loading it would call posix.system" in resumed.output
    assert not marker.exists()


@pytest.mark.slow
def test_a_payload_in_a_deepspeed_file_runs_neither_on_resume_nor_on_export(run_copy, shards, tmp_path):
    marker = tmp_path / "pwned"
    _plant(run_copy / "checkpoints" / LAST / "mp_rank_00_model_states.pt", marker, rehash=True)
    resumed = run_train(run_copy, shards, write_config(tmp_path / "c8.yaml", {"train": {"max_steps": 8}}),
                        check=False)
    assert resumed.returncode != 0
    assert "mp_rank_00_model_states.pt: refused: loading it would call posix.system" in resumed.output
    with pytest.raises(UserError, match=r"mp_rank_00_model_states.pt: refused"):
        export(run_copy, weights="model")
    assert not marker.exists()


# ----------------------------------------------------------------------------- corruption
@pytest.mark.slow
@pytest.mark.parametrize("broken", ["rank-00000.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_resume_falls_back_to_the_newest_intact_checkpoint(run_copy, trained, shards, tmp_path, broken):
    path = run_copy / "checkpoints" / LAST / broken
    data = bytearray(path.read_bytes())
    if broken.startswith("rank"):
        data = data[: len(data) // 2]          # truncated
    else:
        data[len(data) // 2] ^= 0xFF           # one flipped byte in the optimizer state
    path.write_bytes(bytes(data))

    resumed = run_train(run_copy, shards, write_config(tmp_path / "c8.yaml", {"train": {"max_steps": 8}}))
    assert f"checkpoint {LAST}: {path}" in resumed.output and "resuming from step-00000003 instead" in resumed.output
    assert f"resumed from {run_copy / 'checkpoints' / EARLIER}" in resumed.output
    # Steps 4-6 are trained again from step 3 and give the first run's losses; each step
    # is recorded once in metrics.jsonl and in MLflow.
    first = trained.losses()
    again = resumed.losses()
    assert [again[s] for s in (4, 5, 6)] == [first[s] for s in (4, 5, 6)]
    steps = [m["step"] for m in resumed.metrics() if "train/loss" in m]
    assert steps == list(range(1, 9))
    _assert_mlflow_holds_each_step_once(run_copy, list(range(1, 9)))


def _assert_mlflow_holds_each_step_once(run_dir: Path, steps: list[int]) -> None:
    from mlflow.tracking import MlflowClient

    record = json.loads((run_dir / "mlflow_run.json").read_text())
    history = MlflowClient(record["tracking_uri"]).get_metric_history(record["run_id"], "train/loss")
    assert sorted(m.step for m in history) == steps


@pytest.mark.slow
def test_export_of_a_truncated_checkpoint_names_the_file_and_the_intact_step(run_copy):
    path = run_copy / "checkpoints" / LAST / "rank-00000.pt"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(UserError, match=rf"cannot export {LAST}: .*rank-00000.pt has 1000 bytes.*"
                                        rf"`unmask export {run_copy} --checkpoint 3`"):
        export(run_copy)
    assert export(run_copy, step=3).is_dir()


@pytest.mark.slow
def test_a_run_of_an_earlier_unmask_is_refused_by_resume_and_export_in_one_line(run_copy, shards, config):
    for tag in (EARLIER, LAST):
        path = run_copy / "checkpoints" / tag / STATE_FILE
        record = json.loads(path.read_text())
        del record["init_from"]  # a field every checkpoint records since --init-from
        path.write_text(json.dumps(record))
    refusal = (f"{run_copy / 'checkpoints' / LAST / STATE_FILE}: written by an earlier unmask (no init_from); "
               f"train again in a new --run-dir")
    resumed = run_train(run_copy, shards, config, check=False)
    errors = [line for line in resumed.output.splitlines() if "error" in line.lower()]
    assert resumed.returncode == 2 and errors == [f"unmask train: error: {refusal}"], resumed.output[-3000:]
    with pytest.raises(EarlierCheckpoint, match=re.escape(refusal)):
        export(run_copy)


# ----------------------------------------------------------------------------- a broken `latest` pointer
@pytest.mark.slow
def test_a_broken_latest_pointer_falls_back_to_the_newest_intact_checkpoint(run_copy, shards, tmp_path, caplog):
    """Issue 33: `latest` pointing outside the run, empty or garbage is a broken pointer, not a
    run without checkpoints: export and resume use the newest complete one, and say why."""
    latest = run_copy / "checkpoints" / "latest"
    for text in ("", "step-12\x00garbage", "step-00000099"):
        latest.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="unmask.checkpoint"):
            assert intact_checkpoint(run_copy) == (run_copy / "checkpoints" / LAST, [])
        assert f"{latest} " in caplog.text and f"using {LAST} instead" in caplog.text, (text, caplog.text)
    latest.unlink()  # missing beside complete checkpoints: lost, not "no checkpoint yet"
    assert resolve_checkpoint(run_copy) == run_copy / "checkpoints" / LAST
    latest.write_text("../../../../../tmp")
    with caplog.at_level(logging.WARNING, logger="unmask.checkpoint"):
        out = export(run_copy, out_dir=tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["step"] == 6
    assert f"{latest} holds '../../../../../tmp', not the name of a checkpoint of this run" in caplog.text
    latest.write_text("")
    resumed = run_train(run_copy, shards, write_config(tmp_path / "c8.yaml", {"train": {"max_steps": 8}}))
    assert f"{latest} is empty; using {LAST} instead" in resumed.output
    assert f"resumed from {run_copy / 'checkpoints' / LAST}" in resumed.output
    assert latest.read_text() == "step-00000008"
