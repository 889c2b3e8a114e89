"""Checkpoints (``pipeline.run_dir.checkpoint``): committed only when complete and verified
against the files they record; a broken one is named, with the newest intact one that resume and
export use instead and a fix that works when typed; a full disk is said in one line; a checkpoint
a user received runs no code on export, eval or resume; one of an earlier unmask is refused.

The slow tests alter copies of a real 6-step run (DeepSpeed on CPU, checkpoints at steps 3 and 6)
as a malicious author (a ``__reduce__`` payload, with the recorded hashes updated to match) or a
bad disk (truncated or flipped bytes) would leave it, or copies of the session's 2-step micro_run.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from orchestration.cli import build_parser
from pipeline.distributed import Distributed
from pipeline.interchange.export import export
from pipeline.run_dir.checkpoint import (
    STATE_FILE,
    CheckpointManager,
    CheckpointMeta,
    EarlierCheckpoint,
    TrainState,
    _file_records,
    intact_checkpoint,
    read_state,
    resolve_checkpoint,
    verify_checkpoint,
)
from pipeline.run_dir.rank_files import rank_file
from tests.support.cli_runner import cli_env, run_unmask, unmask_command, unmask_in_process
from tests.support.mdlm_reference import Payload as _Payload
from tests.support.paths import REPO
from tests.support.train_helpers import RUN_TIMEOUT_S, run_train, write_config

LAST = "step-00000006"
EARLIER = "step-00000003"


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


ALONE = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


@pytest.fixture
def run(micro_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(micro_run, copy)
    return copy


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-64])


# ------------------------------------------------------------------ the record of a checkpoint
def test_verify_checkpoint_names_a_missing_file(tmp_path):
    directory = tmp_path / "step-00000001"
    directory.mkdir()
    meta = CheckpointMeta(state=TrainState(step=1), config={}, config_sha256="", data_sha256="", tokenizer_sha256="",
                          network={}, zero_stage=1, precision="fp32", batch_plan={}, world_size=1,
                          files={"rank-00000.pt": {"bytes": 3, "sha256": "x"}})
    (directory / STATE_FILE).write_text(meta.to_json())
    assert verify_checkpoint(directory) == f"{directory / 'rank-00000.pt'} is missing"


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


# ------------------------------------------------------------------ code in a checkpoint never runs
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


# ------------------------------------------------------------------ a broken checkpoint: the newest intact one
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
def test_the_fix_of_a_broken_checkpoint_is_a_command_that_parses_and_works(run, capsys):
    _truncate(rank_file(run / "checkpoints" / "step-00000002", 0))
    assert unmask_in_process(["export", str(run)]) == 2
    err = capsys.readouterr().err
    assert "cannot export step-00000002" in err and "(truncated or overwritten)" in err
    hint = re.search(r"export the newest intact one: `(unmask [^`]+)`", err)
    assert hint, err
    argv = shlex.split(hint.group(1))[1:]
    assert build_parser().parse_args(argv).checkpoint == 1
    assert unmask_in_process(argv) == 0 and (run / "export" / "model.safetensors").is_file()


@pytest.mark.slow
def test_with_no_intact_checkpoint_a_run_says_so_once(run, caplog):
    caplog.set_level(logging.WARNING, logger="unmask.checkpoint")
    manager = CheckpointManager(run, ALONE, keep_last=2)
    _truncate(rank_file(run / "checkpoints" / "step-00000002", 0))
    assert manager.newest_intact().name == "step-00000001"
    assert "step-00000002: " in caplog.text and "resuming from step-00000001 instead" in caplog.text
    caplog.clear()
    _truncate(rank_file(run / "checkpoints" / "step-00000001", 0))
    with pytest.raises(UserError, match=r"no intact checkpoint to resume from \(step-00000002: .*; step-00000001: .*\); "
                                        r"restore them, or move the checkpoints away to start over"):
        manager.newest_intact()
    assert caplog.text == "", "a warning said the run would resume, then it refused"


@pytest.mark.slow
def test_a_broken_latest_pointer_falls_back_to_the_newest_intact_checkpoint(run_copy, shards, tmp_path, caplog):
    """`latest` pointing outside the run, empty or garbage is a broken pointer, not a
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


# ------------------------------------------------------------------ a full disk
# Room for the run's small files and one checkpoint of the micro model (about 2.5 MB), not
# for a second one. (The MLflow store is not in the run dir: see pipeline.tracking.tracker.)
DISK = "4m"


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _namespaces_work(), reason="unprivileged user and mount namespaces are not available")
def test_a_full_disk_is_named_in_one_line_with_the_last_intact_checkpoint(tinyshakespeare_shards, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    run_dir = disk / "run"
    config = write_config(tmp_path / "c.yaml", {"eval": {"every": 0}})  # checkpoints at steps 3 and 6
    command = unmask_command(["train", "--config", str(config), "--data", str(tinyshakespeare_shards),
                              "--run-dir", str(run_dir)])
    script = f"mount -t tmpfs -o size={DISK} tmpfs {shlex.quote(str(disk))} && {shlex.join(command)}; " \
             f"status=$?; ls {shlex.quote(str(run_dir / 'checkpoints'))}; exit $status"
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=REPO,
                          env=cli_env(),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    full = [line for line in output.splitlines() if "No space left on device" in line]
    assert full, output[-3000:]
    assert f"the last intact checkpoint is {run_dir / 'checkpoints' / 'step-00000003'}" in full[-1]
    assert "--resume auto" in full[-1] and "Traceback" not in output
    listed = done.stdout.split()
    assert "step-00000003" in listed and "step-00000006" not in listed, "the partial save is removed"
