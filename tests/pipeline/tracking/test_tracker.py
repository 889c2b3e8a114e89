"""MLflow tracking (``pipeline.tracking.tracker``) against a real ``mlflow server`` and the run
directory's own SQLite store: round trip, resume into the same run, refused forks and param
changes, param flattening, and a server down at the start of a training."""

import json
import math
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
)

from common.errors import UserError
from pipeline.run_dir.layout import RunLayout
from pipeline.tracking.tracker import (
    RUN_DIR_TAG,
    Tracker,
    default_tracking_uri,
    flatten_params,
)
from tests.support.mlflow_server import free_port
from tests.support.train_helpers import run_train, write_config


def _experiment() -> str:
    """A fresh experiment per test: the server is shared by the whole session."""
    return f"test-{uuid.uuid4().hex[:12]}"


def _record(run_dir: Path) -> dict:
    return json.loads(RunLayout(run_dir).mlflow_record.read_text())


def test_round_trip_through_server(mlflow_server: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    tracker = Tracker.open(run_dir, tracking_uri=mlflow_server, experiment=_experiment(),
                           run_name="round-trip")
    # More params and metrics than one MLflow request takes (MlflowClient splits them).
    params = flatten_params({"train": {"lr": 3e-4, "betas": [0.9, 0.95]},
                             "layers": {f"l{i}": i for i in range(MAX_PARAMS_TAGS_PER_BATCH + 5)}})
    tracker.log_params(params)
    tracker.log_params(params)  # same values again: a no-op, not an error
    wide = {f"probe/{i}": float(i) for i in range(MAX_METRICS_PER_BATCH + 5)}
    tracker.log_metrics(wide, step=0)
    for step in range(5):
        tracker.log_metrics({"loss": 1.0 / (step + 1), "grad_norm": math.nan}, step=step)
    tracker.set_tags({"git_commit": "abc123"})
    config = tmp_path / "config.yaml"
    config.write_text("lr: 0.0003\n")
    tracker.log_artifact(config, "config")
    tracker.log_text("hello", "notes/readme.txt")
    tracker.finish()

    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(tracker.run_id)
    assert run.data.params == params
    assert run.data.tags["git_commit"] == "abc123"
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "round-trip"
    assert run.info.experiment_id == tracker.experiment_id
    loss = sorted((m.step, m.value) for m in client.get_metric_history(tracker.run_id, "loss"))
    assert loss == [(step, 1.0 / (step + 1)) for step in range(5)]
    assert tracker.metric_history("loss") == loss
    assert [step for step, value in tracker.metric_history("grad_norm") if math.isnan(value)] == \
        list(range(5))
    assert len(run.data.metrics) == len(wide) + 2
    listed = client.list_artifacts(tracker.run_id, "config")
    assert [artifact.path for artifact in listed] == ["config/config.yaml"]
    notes = client.download_artifacts(tracker.run_id, "notes/readme.txt", str(tmp_path))
    assert Path(notes).read_text() == "hello"
    assert _record(run_dir) == dict(tracking_uri=mlflow_server, run_id=tracker.run_id,
                                    experiment_id=tracker.experiment_id)


def test_resume_continues_the_same_run(mlflow_server: str, tmp_path: Path) -> None:
    experiment = _experiment()
    first = Tracker.open(tmp_path, tracking_uri=mlflow_server, experiment=experiment)
    first.log_params({"train.lr": "0.1"})
    for step in range(3):
        first.log_metrics({"loss": float(step)}, step=step)
    first.finish("KILLED")  # the job was preempted

    second = Tracker.open(tmp_path, experiment=experiment)  # URI from mlflow_run.json
    client = MlflowClient(tracking_uri=mlflow_server)
    assert (second.run_id, second.tracking_uri) == (first.run_id, mlflow_server)
    assert client.get_run(second.run_id).info.status == "RUNNING"
    second.log_params({"train.lr": "0.1"})
    second.log_metrics({"loss": 3.0}, step=3)
    assert second.metric_history("loss") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert len(client.search_runs([first.experiment_id])) == 1
    # The same server spelled with a trailing slash is not a different store.
    assert Tracker.open(tmp_path, tracking_uri=mlflow_server + "/").run_id == first.run_id


def test_changed_param_on_resume_is_refused(mlflow_server: str, tmp_path: Path) -> None:
    first = Tracker.open(tmp_path, tracking_uri=mlflow_server, experiment=_experiment())
    first.log_params({"train.lr": "0.001", "train.steps": "100"})
    resumed = Tracker.open(tmp_path)
    with pytest.raises(UserError, match=r"train\.lr.*0\.001.*0\.002"):
        resumed.log_params({"train.lr": "0.002", "train.steps": "100"})
    assert MlflowClient(mlflow_server).get_run(first.run_id).data.params["train.lr"] == "0.001"


def test_different_tracking_uri_on_resume_is_refused(mlflow_server: str, tmp_path: Path) -> None:
    Tracker.open(tmp_path, tracking_uri=mlflow_server, experiment=_experiment())
    other = f"sqlite:///{tmp_path / 'other.db'}"
    with pytest.raises(UserError) as refused:
        Tracker.open(tmp_path, tracking_uri=other)
    assert mlflow_server in str(refused.value) and other in str(refused.value)
    assert not (tmp_path / "other.db").exists()  # refused before touching the other store


def test_recorded_run_missing_from_server_is_refused(mlflow_server: str, tmp_path: Path) -> None:
    run_id = uuid.uuid4().hex
    record = dict(tracking_uri=mlflow_server, run_id=run_id, experiment_id="0")
    RunLayout(tmp_path).mlflow_record.write_text(json.dumps(record))
    with pytest.raises(UserError, match=f"run {run_id} does not exist"):
        Tracker.open(tmp_path)


def test_recorded_local_store_missing_is_refused(tmp_path: Path) -> None:
    moved_from = f"sqlite:///{tmp_path / 'old-location' / 'mlflow.db'}"
    record = dict(tracking_uri=moved_from, run_id=uuid.uuid4().hex, experiment_id="0")
    RunLayout(tmp_path).mlflow_record.write_text(json.dumps(record))
    with pytest.raises(UserError, match="does not exist"):
        Tracker.open(tmp_path)
    assert not (tmp_path / "old-location").exists()  # no empty store created there


def test_runs_share_one_default_store_that_mlflow_ui_finds(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("UNMASK_HOME", str(tmp_path / "home"))
    first, second = Tracker.open(tmp_path / "run-a"), Tracker.open(tmp_path / "run-b")
    store = tmp_path / "home" / "mlflow"
    assert first.tracking_uri == second.tracking_uri == default_tracking_uri() == f"sqlite:///{store / 'mlflow.db'}"
    first.log_text("lr: 0.1\n", "config/resolved.yaml")
    first.finish()
    assert [p.read_text() for p in store.rglob("resolved.yaml")] == ["lr: 0.1\n"]  # artifacts beside it
    assert sorted(p.name for p in (tmp_path / "run-a").iterdir()) == [RunLayout(tmp_path).mlflow_record.name]
    runs = MlflowClient(first.tracking_uri).search_runs([first.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["run-a", "run-b"]  # named after their run dirs
    tags = runs[0].data.tags
    assert {"mlflow.source.name", "mlflow.source.type", "mlflow.user"} <= tags.keys()
    assert tags[RUN_DIR_TAG] in (str((tmp_path / "run-a").resolve()), str((tmp_path / "run-b").resolve()))


def test_mlflow_tracking_uri_is_honoured(tmp_path: Path, monkeypatch) -> None:
    uri = f"sqlite:///{tmp_path / 'team.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert Tracker.open(tmp_path / "run").tracking_uri == uri and (tmp_path / "team.db").is_file()


def test_flatten_params() -> None:
    config = {
        "train": {"lr": 0.0003, "betas": [0.9, 0.95], "warmup": None, "ema": True,
                  "shape": (2, 3), "opt": {"name": "adamw", "fused": False}},
        "data": {},
        "note": "x" * (MAX_PARAM_VAL_LENGTH + 10),
        3: "int key",
    }
    flat = flatten_params(config, prefix="cfg")
    note = flat.pop("cfg.note")
    assert flat == {
        "cfg.train.lr": "0.0003", "cfg.train.betas": "[0.9, 0.95]", "cfg.train.warmup": "null",
        "cfg.train.ema": "true", "cfg.train.shape": "[2, 3]", "cfg.train.opt.name": "adamw",
        "cfg.train.opt.fused": "false", "cfg.data": "{}", "cfg.3": "int key",
    }
    assert len(note) == MAX_PARAM_VAL_LENGTH and note.startswith("xxx")
    assert note.endswith(f"[truncated from {MAX_PARAM_VAL_LENGTH + 10} chars]")
    assert flatten_params({"a": {"b": 1}}) == {"a.b": "1"}


@pytest.mark.slow
def test_two_training_runs_compare_in_one_experiment_on_a_server(mlflow_server: str, tinyshakespeare_shards,
                                                                  tmp_path: Path) -> None:
    """What a user compares in the UI: two runs, one experiment (named by the user), each run
    named after its run dir, with the resolved model shape and MLflow's source tags."""
    from tests.support.train_helpers import run_train, write_config

    experiment = _experiment()
    for name, lr in (("lr-high", "2e-3"), ("lr-low", "5e-4")):
        config = write_config(tmp_path / f"{name}.yaml", {"train": {"max_steps": 2}})
        run_train(tmp_path / name, tinyshakespeare_shards, config,
                  extra=["--mlflow-uri", mlflow_server, "--logging.experiment", experiment, "--optim.lr", lr])
    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["lr-high", "lr-low"]
    for run in runs:
        params, tags = run.data.params, run.data.tags
        assert params["model.n_layers"] == "2" and params["resolved.network.n_heads"] == "2"
        assert params["resolved.network.max_seq_len"] == "64"  # from the data, not the config
        assert tags.get("mlflow.source.git.commit", "unknown") == tags["git_commit"] and "mlflow.user" in tags
        assert "train/loss" in run.data.metrics
    assert {r.data.params["optim.lr"] for r in runs} == {"0.002", "0.0005"}


@pytest.mark.slow
def test_a_server_down_at_the_start_stops_the_run_naming_it_unless_optional(tinyshakespeare_shards, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    config = write_config(tmp_path / "c.yaml", {"train": {"max_steps": 2}})
    refused = run_train(tmp_path / "a", tinyshakespeare_shards, config, extra=["--mlflow-uri", dead], check=False)
    assert refused.returncode != 0
    assert f"MLflow tracking server {dead} did not answer for 30 s" in refused.output
    assert "--logging.mlflow_required false" in refused.output and "Traceback" not in refused.output

    optional = run_train(tmp_path / "b", tinyshakespeare_shards, config,
                         extra=["--mlflow-uri", dead, "--logging.mlflow_required", "false"])
    assert "Training without MLflow" in optional.output
    assert [m["step"] for m in optional.metrics() if "train/loss" in m] == [1, 2]
