"""``unmask sweep`` end to end on a local Ray: trials as ordinary run directories, a failing trial
retried then reported, the MLflow parent and its children on a real server, and a sweep killed
mid-trial that resumes with its finished trials untouched."""

from __future__ import annotations

import json
import signal

import psutil
import pytest
from mlflow.tracking import MlflowClient

from orchestration.exit_codes import FAILED_PARTS
from orchestration.sweep.tracking import PARENT_TAG
from pipeline.run_dir.checkpoint import latest_step
from tests.support.cli_runner import run_unmask, start_unmask
from tests.support.shard_fixtures import tree_bytes
from tests.support.stall import ANNOUNCEMENT

pytestmark = pytest.mark.slow
# Adam's first step at this rate overflows the weights: every later loss is non-finite, and the
# loop gives up after one such step (train.max_skipped_steps) — a real failure, every attempt.
DIVERGING = {"optim.lr": 1e38, "train.max_skipped_steps": 1}
RAY_CPUS = "2"


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory, tinyshakespeare_shards, mlflow_server):
    """A sweep of three trials (ar, mdlm and one that diverges) logged to the MLflow server."""
    import yaml

    from tests.cli.sweep.conftest import SWEEP
    from tests.support.train_helpers import write_config

    root = tmp_path_factory.mktemp("sweep")
    config = write_config(root / "micro.yaml", {"logging": {"mlflow_uri": mlflow_server, "every": 50,
                                                            "experiment": "sweep-on-ray"}})
    sweep = root / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({**SWEEP, "config": config.name, "data": str(tinyshakespeare_shards),
                                     "processes": {"ar": {"model.objective": "autoregressive"}, "mdlm": {},
                                                   "diverging": DIVERGING}, "reference": "ar"}))
    out = root / "out"
    proc = run_unmask(["sweep", str(sweep), "--out", str(out), "--num-cpus", RAY_CPUS])
    return proc, out, mlflow_server, sweep


def test_each_trial_is_an_ordinary_run_with_its_final_bound(finished_sweep):
    proc, out, *_ = finished_sweep
    assert proc.returncode == FAILED_PARTS and "failed after their retries" in proc.stderr, \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    trials = {t["name"]: t for t in summary["trials"]}
    for name in ("ar-C4e9-d32-l1", "mdlm-C4e9-d32-l1"):
        trial, run = trials[name], out / "trials" / name
        assert trial["status"] == "finished" and trial["attempts"] == 1
        assert latest_step(run) == trial["steps"] and json.loads((run / ".unmask-output.json").read_text())["kind"] == "run"
        last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if "val/nelbo_per_token" in line][-1]
        assert last["step"] == trial["steps"] and last["val/nelbo_per_token"] == trial["nelbo_per_token"]
    assert 0 < trials["ar-C4e9-d32-l1"]["nelbo_per_token"] < 10
    assert (out / "report" / "report.html").is_file() and (out / "report" / "isoflop.png").is_file()


def test_a_failing_trial_is_retried_then_reported(finished_sweep):
    proc, out, *_ = finished_sweep
    failed = json.loads((out / "state" / "diverging-C4e9-d32-l1.json").read_text())
    assert failed["status"] == "failed" and failed["attempts"] == 2   # max_retries 1: two attempts
    assert "non-finite" in failed["error"] and "\n" not in failed["error"]
    assert "1 trial(s) failed after their retries: diverging-C4e9-d32-l1" in proc.stderr
    assert "diverging-C4e9-d32-l1" in (out / "report" / "summary.md").read_text()


def test_the_sweep_is_a_parent_run_and_each_trial_its_child(finished_sweep):
    _, out, server, _ = finished_sweep
    client = MlflowClient(tracking_uri=server)
    parent_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.status == "FAILED" and parent.data.tags["sweep.trials"] == "3"
    assert {a.path for a in client.list_artifacts(parent_id, "sweep")} >= {"sweep/isoflop.png", "sweep/report.html",
                                                                          "sweep/summary.json"}
    # the diverging trial failed before its first checkpoint: its run gave its directory back
    assert not (out / "trials" / "diverging-C4e9-d32-l1").exists()
    for name in ("ar-C4e9-d32-l1", "mdlm-C4e9-d32-l1"):
        child_id = json.loads((out / "trials" / name / "mlflow_run.json").read_text())["run_id"]
        child = client.get_run(child_id)
        assert child.data.tags[PARENT_TAG] == parent_id
        assert child.data.params["sweep.process"] == name.split("-")[0] and child.data.params["sweep.budget"] == "4e+09"
    child = client.get_run(json.loads((out / "trials" / "ar-C4e9-d32-l1" / "mlflow_run.json").read_text())["run_id"])
    summary = {t["name"]: t for t in json.loads((out / "summary.json").read_text())["trials"]}
    assert child.data.metrics["sweep/nelbo_per_token"] == pytest.approx(summary["ar-C4e9-d32-l1"]["nelbo_per_token"])


def _kill_tree(pid: int) -> None:
    root = psutil.Process(pid)
    processes = [root, *root.children(recursive=True)]
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=60)
    assert not alive, f"left running: {alive}"


def test_a_killed_sweep_resumes_with_its_finished_trials_untouched(finished_sweep):
    """Last in the module: it grows the finished sweep by a size, kills it mid-trial, resumes it."""
    import yaml

    _, out, _, sweep = finished_sweep
    finished = out / "trials" / "mdlm-C4e9-d32-l1"
    before = tree_bytes(finished)
    # A second size joins; its training is killed (driver, Ray and workers) after step 15, its
    # checkpoint at step 12 written (checkpoints: 2 of its 24 steps).
    grown = sweep.with_name("grown.yaml")
    grown.write_text(yaml.safe_dump({**yaml.safe_load(sweep.read_text()), "processes": {"mdlm": {}},
                                     "sizes": [{"d_model": 32}, {"d_model": 48}], "reference": None}))
    proc = start_unmask(["sweep", str(grown), "--out", str(out), "--num-cpus", RAY_CPUS], stall_after=15,
                        env={"PYTHONUNBUFFERED": "1"}, start_new_session=True)   # Ray's forwarded lines, as printed
    try:
        for line in proc.stdout:
            if ANNOUNCEMENT in line:
                break
    finally:
        _kill_tree(proc.pid)
        proc.communicate()
    interrupted = out / "trials" / "mdlm-C4e9-d48-l1"
    checkpoint = latest_step(interrupted)
    assert checkpoint is not None and 0 < checkpoint < 15
    again = run_unmask(["sweep", str(grown), "--out", str(out), "--num-cpus", RAY_CPUS])
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "2 trials, 1 finished before, 1 to run" in again.stdout
    assert f"resumed from {interrupted / 'checkpoints'}" in again.stdout + again.stderr
    assert tree_bytes(finished) == before
    state = json.loads((out / "state" / "mdlm-C4e9-d48-l1.json").read_text())
    assert state["status"] == "finished" and state["attempts"] == 2 and state["step"] == latest_step(interrupted)
