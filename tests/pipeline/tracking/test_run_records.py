"""What a training run records as it goes (``pipeline.tracking.run_records``): on two ranks, one
metrics.jsonl and one MLflow run, found by the run directory's tag, with the resolved params."""

from __future__ import annotations

import json

import pytest

from pipeline.tracking.tracker import RUN_DIR_TAG


@pytest.mark.slow
def test_two_ranks_share_one_mlflow_run_and_one_metrics_log(reference_runs):
    run = reference_runs[2, 2]
    steps = [m["step"] for m in run.metrics() if "train/loss" in m]
    assert steps == [1, 2, 3, 4, 5, 6]  # rank 0 alone logs
    recorded = json.loads((run.run_dir / "mlflow_run.json").read_text())
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=recorded["tracking_uri"])
    of_this_run_dir = f"tags.`{RUN_DIR_TAG}` = '{run.run_dir.resolve()}'"
    assert len(client.search_runs([recorded["experiment_id"]], of_this_run_dir)) == 1
    history = client.get_metric_history(recorded["run_id"], "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]
    params = client.get_run(recorded["run_id"]).data.params
    assert params["train.zero_stage"] == "2" and params["resolved.world_size"] == "2"
    assert (params["train.attention"], params["resolved.attention"], params["resolved.compile"]) == \
        ("auto", "flash", "false")
