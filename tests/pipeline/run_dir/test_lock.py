"""One trainer per run directory: the lock, its holder's name, stale locks, the same job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from orchestration.exit_codes import PREEMPTED
from pipeline.run_dir.layout import RunLayout
from pipeline.run_dir.lock import JOB_ID_ENV, RunDirLocked, RunLock
from tests.support.cli_runner import start_unmask
from tests.support.paths import REPO
from tests.support.stall import ANNOUNCEMENT
from tests.support.train_helpers import RUN_TIMEOUT_S, Run, run_train, write_config

HOLD = """
import sys
from pipeline.run_dir.lock import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
sys.stdin.read()   # hold until the test closes stdin or kills us
"""


def _holder(run_dir, env=None) -> subprocess.Popen:
    """Another process holding the run directory's lock."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    assert process.stdout.readline().strip() == "locked"
    return process


def test_a_second_holder_is_refused_with_the_first_ones_name(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(RunDirLocked, match=rf"is being trained by pid {holder.pid} on host .*: wait for it"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path, caplog):
    holder = _holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads(RunLayout(tmp_path).lock.read_text())["pid"] == holder.pid  # the dead holder's record
    caplog.set_level("INFO", logger="unmask.train")
    with RunLock(tmp_path):
        assert json.loads(RunLayout(tmp_path).lock.read_text())["pid"] == os.getpid()
    assert f"from pid {holder.pid}" in caplog.text and "no longer running" in caplog.text


def test_the_same_job_waits_for_its_previous_worker(tmp_path, monkeypatch):
    holder = _holder(tmp_path, env={JOB_ID_ENV: "job-1"})
    monkeypatch.setenv(JOB_ID_ENV, "job-1")
    acquired = threading.Event()
    lock = RunLock(tmp_path)
    waiter = threading.Thread(target=lambda: (lock.acquire(), acquired.set()))
    waiter.start()
    holder.stdin.close()  # the previous worker of the job exits
    holder.wait()
    waiter.join(timeout=60)
    assert acquired.is_set()
    lock.release()


def test_another_job_does_not_wait(tmp_path, monkeypatch):
    holder = _holder(tmp_path, env={JOB_ID_ENV: "job-1"})
    monkeypatch.setenv(JOB_ID_ENV, "job-2")
    try:
        with pytest.raises(RunDirLocked):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()


def test_a_second_lock_in_the_same_process_is_refused_without_releasing_the_first(tmp_path, monkeypatch):
    """A POSIX record lock is the process's: a second one of the process would not conflict, and
    closing any descriptor of the file would release it. The second is refused, and the first holds."""
    monkeypatch.setenv(JOB_ID_ENV, "job-1")
    first = RunLock(tmp_path)
    first.acquire()
    try:
        monkeypatch.setenv(JOB_ID_ENV, "job-2")
        with pytest.raises(RunDirLocked, match=rf"is being trained by pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
        other = subprocess.run([sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                               timeout=60)
        assert other.returncode != 0 and "is being trained by" in other.stderr  # still held
        monkeypatch.setenv(JOB_ID_ENV, "job-1")  # a restarted worker group of the same job, in this process
        second = RunLock(tmp_path)
        waiter = threading.Thread(target=second.acquire)
        waiter.start()
    finally:
        first.release()
    waiter.join(timeout=60)
    assert second._fd is not None, "the same job's next loop did not take the lock once the first let it go"
    second.release()


@pytest.mark.slow
def test_a_second_trainer_on_a_run_dir_exits_at_once_naming_the_first(tinyshakespeare_shards, tmp_path):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", {"train": {"max_steps": 4}})
    args = ["--config", str(config), "--data", str(tinyshakespeare_shards), "--run-dir", str(run_dir)]
    first = start_unmask(["train", *args], stall_after=2)
    try:
        for line in first.stdout:
            if ANNOUNCEMENT in line:
                break
        second = run_train(run_dir, tinyshakespeare_shards, config, check=False)
        assert second.returncode != 0
        assert f"is being trained by pid {first.pid}" in second.output
        first.send_signal(signal.SIGTERM)  # the first one checkpoints and stops as preempted
        assert first.wait(timeout=RUN_TIMEOUT_S) == PREEMPTED
    finally:
        if first.poll() is None:
            first.kill()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert steps == [1, 2], "the second trainer wrote nothing"


@pytest.mark.slow
def test_a_trainer_killed_before_its_first_checkpoint_is_rerun_at_once_and_logs_each_step_once(
        tinyshakespeare_shards, tmp_path):
    """The trainer's DataLoader worker outlives a SIGKILL by seconds. The lock is the trainer's
    alone, so it is free the moment the trainer dies; the rerun starts from scratch, and
    metrics.jsonl and MLflow hold each step once."""
    import psutil

    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", {"train": {"max_steps": 2}, "data": {"num_workers": 1},
                                                "eval": {"every": 2, "batches": 1}})
    args = ["--config", str(config), "--data", str(tinyshakespeare_shards), "--run-dir", str(run_dir)]
    trainer = start_unmask(["train", *args], stall_after=2)  # stalls before the checkpoint of its last step
    workers = []
    try:
        for line in trainer.stdout:
            if ANNOUNCEMENT in line:
                break
        workers = psutil.Process(trainer.pid).children(recursive=True)
        assert workers, "the trainer runs no DataLoader worker"
        trainer.kill()
        trainer.wait()
        assert any(worker.is_running() for worker in workers), "its workers died with it: nothing to test"
        with RunLock(run_dir):  # at once, while the orphans still run
            pass
    finally:
        for process in [trainer, *workers]:
            try:
                process.kill()
            except (OSError, psutil.NoSuchProcess):
                pass
    killed = Run(0, "", run_dir)
    assert not (run_dir / "checkpoints").exists() and killed.losses().keys() == {1, 2}
    rerun = run_train(run_dir, tinyshakespeare_shards, config)
    records = [(m["step"], key) for m in rerun.metrics() for key in m if key != "step"]
    assert len(records) == len(set(records)) and {step for step, _ in records} == {0, 1, 2}
    from mlflow.tracking import MlflowClient

    recorded = json.loads((run_dir / "mlflow_run.json").read_text())
    history = MlflowClient(recorded["tracking_uri"]).get_metric_history(recorded["run_id"], "val/nelbo_per_token")
    assert sorted(m.step for m in history) == [0, 2]
