"""A disk that fills up during training: one line that says so and names the checkpoint to
resume from; the partial checkpoint is removed and the earlier one stays intact.

The run directory lives on a small tmpfs mounted in a private mount namespace
(``unshare --user --map-root-user --mount``), so the test needs no privileges of its own
and touches no real disk."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from pipeline.run_dir.checkpoint import STATE_FILE, CheckpointMeta, TrainState, verify_checkpoint
from tests.support.cli_runner import cli_env, unmask_command
from tests.support.paths import REPO
from tests.support.train_helpers import RUN_TIMEOUT_S, write_config

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


def test_verify_checkpoint_names_a_missing_file(tmp_path):
    directory = tmp_path / "step-00000001"
    directory.mkdir()
    meta = CheckpointMeta(state=TrainState(step=1), config={}, config_sha256="", data_sha256="", tokenizer_sha256="",
                          network={}, zero_stage=1, precision="fp32", batch_plan={}, world_size=1,
                          files={"rank-00000.pt": {"bytes": 3, "sha256": "x"}})
    (directory / STATE_FILE).write_text(meta.to_json())
    assert verify_checkpoint(directory) == f"{directory / 'rank-00000.pt'} is missing"
