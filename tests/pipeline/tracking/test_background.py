"""Tracking that never blocks a training step (``pipeline.tracking.background``): during an
outage of the tracking server the loop keeps stepping, and the metrics of the outage reach MLflow
once the server is back, each step once; steps a dead server did not receive are named; steps
logged before a restart are not logged again."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import threading
import time

import pytest
from mlflow.tracking import MlflowClient

from orchestration.exit_codes import PREEMPTED
from pipeline.tracking.background import BackgroundTracker
from pipeline.tracking.tracker import Tracker
from tests.support.cli_runner import start_unmask
from tests.support.mlflow_server import free_port, running_mlflow_server
from tests.support.train_helpers import RUN_TIMEOUT_S, write_config

STEP_LINE = "unmask.train: step "
WAIT_S = 240  # for an expected line; a hung loop fails here instead of hanging the suite


class _Lines:
    """The training's output, read on a thread (a full pipe would block the loop)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self.lines.put(line)

    def until(self, predicate) -> str:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            self.seen.append(line)
            if predicate(line):
                return line
        raise AssertionError("expected line never came:\n" + "".join(self.seen[-40:]))


def _step_of(line: str) -> int:
    return int(line.split(STEP_LINE, 1)[1].split("/", 1)[0])


def _is_step(line: str) -> bool:
    return STEP_LINE in line and "/" in line.split(STEP_LINE, 1)[1].split()[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_outage_during_training_blocks_no_step_and_loses_no_metric(tinyshakespeare_shards, tmp_path):
    root, port = tmp_path / "mlflow", free_port()
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "long.yaml", {"train": {"max_steps": 1_000_000},
                                                    "eval": {"every": 0}, "checkpoint": {"every": 1_000_000}})
    args = ["--config", str(config), "--data", str(tinyshakespeare_shards), "--run-dir", str(run_dir)]
    with running_mlflow_server(root, port) as url:
        process = start_unmask(["train", *args, "--mlflow-uri", url])
        output = _Lines(process)
        output.until(lambda line: _is_step(line) and _step_of(line) >= 5)
    try:
        noticed = output.until(lambda line: "failed to take the records" in line)
        assert url in noticed and "training continues" in noticed
        outage_step = _step_of(output.until(_is_step))
        output.until(lambda line: _is_step(line) and _step_of(line) >= outage_step + 50)  # steps go on
        with running_mlflow_server(root, port):
            output.until(lambda line: "takes records again" in line)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=RUN_TIMEOUT_S) == PREEMPTED, "".join(output.seen[-40:])
            record = json.loads((run_dir / "mlflow_run.json").read_text())
            client = MlflowClient(url)
            history = sorted(m.step for m in client.get_metric_history(record["run_id"], "train/loss"))
            status = client.get_run(record["run_id"]).info.status
    finally:
        if process.poll() is None:
            process.kill()
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in line]
    assert logged == list(range(1, len(logged) + 1)) and len(logged) > outage_step + 50
    assert history == logged, "every step once, those of the outage included"
    assert status == "KILLED"


def test_close_names_the_steps_a_dead_server_did_not_receive(tmp_path, caplog):
    dead = f"http://127.0.0.1:{free_port()}"
    tracker = Tracker(MlflowClient(dead), "0" * 32, dead, "0")
    background = BackgroundTracker(tracker, metrics_file="RUN/metrics.jsonl")
    for step in (1, 2, 3):
        background.log_metrics({"train/loss": 1.0}, step)
    assert background.close("FINISHED", wait_s=1.0) is False
    assert "did not receive steps 1..3 (3 steps) and the run's final status" in caplog.text
    assert "RUN/metrics.jsonl" in caplog.text


def test_steps_logged_before_a_restart_are_not_logged_again(mlflow_server, tmp_path):
    tracker = Tracker.open(tmp_path / "run", tracking_uri=mlflow_server, experiment="outage-skip")
    for step in (1, 2, 3):
        tracker.log_metrics({"train/loss": float(step)}, step)
    resumed_at = 1  # a checkpoint at step 1: steps 2 and 3 are trained (and logged) again
    background = BackgroundTracker(tracker, skip=tracker.logged_steps_after(resumed_at))
    for step in (2, 3, 4):
        background.log_metrics({"train/loss": float(step) + 0.5}, step)
    assert background.close("FINISHED")
    history = MlflowClient(mlflow_server).get_metric_history(tracker.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5)]
