"""The `tiny` preset learns: a short run on tinyshakespeare lowers the validation bound
clearly, and the run is tracked on a real MLflow server."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from data_prep.shards.format import Manifest
from pipeline.interchange.export import export
from tests.support.train_helpers import run_train, write_config

pytestmark = pytest.mark.slow

# Nats per token the bound must fall by in 40 steps: from about log V (5.95 for V = 384,
# the untrained model) to well below it; a broken objective or optimizer stays near log V.
REQUIRED_DROP = 0.5


def test_tiny_learns_and_reports_to_an_mlflow_server(tmp_path, tinyshakespeare_shards, mlflow_server):
    config = write_config(tmp_path / "tiny.yaml", {
        "model": {"preset": "tiny", "n_layers": None, "d_model": None, "n_heads": None},
        "train": {"max_steps": 40, "global_batch_size": 16, "micro_batch_size": None, "ema_decay": 0.9},
        "optim": {"lr": 2.0e-3, "warmup_steps": 5, "decay": "cosine"},
        "eval": {"every": 20, "batches": 4}, "checkpoint": {"every": 40}, "logging": {"every": 5}})
    run = run_train(tmp_path / "run", tinyshakespeare_shards, config, extra=["--mlflow-uri", mlflow_server])
    bounds = run.validations()
    assert sorted(bounds) == [0, 20, 40]
    assert bounds[40] < bounds[0] - REQUIRED_DROP, bounds

    record = json.loads((run.run_dir / "mlflow_run.json").read_text())
    assert record["tracking_uri"] == mlflow_server
    client = MlflowClient(tracking_uri=mlflow_server)
    tracked = client.get_run(record["run_id"])
    assert tracked.info.status == "FINISHED"
    assert tracked.data.params["model.preset"] == "tiny" and tracked.data.params["optim.lr"] == "0.002"
    assert tracked.data.tags["data_manifest_sha256"] == Manifest.read(tinyshakespeare_shards).sha256()
    assert len(tracked.data.tags["git_commit"]) in (40, len("unknown"))
    val = client.get_metric_history(record["run_id"], "val/nelbo_per_token")
    assert {m.step: m.value for m in val} == bounds
    loss_steps = sorted(m.step for m in client.get_metric_history(record["run_id"], "train/loss"))
    assert loss_steps == [5, 10, 15, 20, 25, 30, 35, 40]
    for key in ("train/lr", "train/grad_norm", "train/tokens_per_second", "train/step_time", "val/bits_per_byte"):
        assert key in tracked.data.metrics, key
    artifacts = {a.path for a in client.list_artifacts(record["run_id"])}
    assert {"config.json", "deepspeed_config.json"} <= artifacts

    export(run.run_dir)  # the final export's config joins the run's artifacts
    assert {a.path for a in client.list_artifacts(record["run_id"], "export")} == {"export/config.json"}
    assert client.get_run(record["run_id"]).info.status == "FINISHED"
