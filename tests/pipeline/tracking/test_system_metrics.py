"""The machine's metrics in a training's MLflow run (``pipeline.tracking.system_metrics``): a real
training logs them to the suite's real MLflow server; a server that is not there costs them, never
the run."""

from __future__ import annotations

import json
import logging
import time

import pytest
from mlflow.tracking import MlflowClient

from pipeline.tracking.system_metrics import STOP_WAIT_S, SystemMetrics
from pipeline.tracking.tracker import HTTP_ENV_DEFAULTS
from tests.support.mlflow_server import free_port
from tests.support.train_helpers import run_train, write_config

# MLflow's own names (mlflow.system_metrics.metrics.cpu_monitor), under system/.
HOST_METRICS = ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes",
                "system/system_memory_usage_percentage")


@pytest.mark.slow
def test_a_training_logs_the_machines_metrics_to_its_mlflow_run(tmp_path, shards, mlflow_server):
    config = write_config(tmp_path / "c.yaml", {"logging": {"system_metrics_interval": 0.2}})
    run = run_train(tmp_path / "run", shards, config, extra=["--mlflow-uri", mlflow_server])
    run_id = json.loads((run.run_dir / "mlflow_run.json").read_text())["run_id"]
    client = MlflowClient(tracking_uri=mlflow_server)
    tracked = client.get_run(run_id)
    assert tracked.info.status == "FINISHED"
    for key in HOST_METRICS:
        assert key in tracked.data.metrics, (key, sorted(tracked.data.metrics))
    cpu = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert cpu and all(0 <= point.value <= 100 for point in cpu)
    assert sorted(point.step for point in cpu) == list(range(len(cpu)))  # one step per sample
    memory = client.get_metric_history(run_id, "system/system_memory_usage_megabytes")
    assert all(point.value > 0 for point in memory)
    assert "train/loss" in tracked.data.metrics  # beside the run's own curves


def test_no_interval_means_no_monitor(mlflow_server):
    assert SystemMetrics.start(mlflow_server, "any-run", 0) is None


def test_a_server_that_is_not_there_costs_the_metrics_never_the_caller(monkeypatch, caplog):
    for name, value in HTTP_ENV_DEFAULTS.items():  # as Tracker.open sets them for the run
        monkeypatch.setenv(name, value)
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level(logging.WARNING):
        started = time.monotonic()
        metrics = SystemMetrics.start(uri, "no-such-run", 0.05)
        if metrics is not None:
            metrics.stop()
        took = time.monotonic() - started
    assert took < STOP_WAIT_S  # neither start nor stop waits out the server
    assert any(record.name.startswith(("mlflow", "unmask")) for record in caplog.records)  # said, not raised
