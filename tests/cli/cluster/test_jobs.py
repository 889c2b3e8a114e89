"""``unmask submit`` and ``unmask jobs`` against a real Ray head (token auth on, 127.0.0.1),
with the end-to-end ``unmask run`` as the job and a real ``mlflow server``."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.support.cli_runner import run_unmask
from tests.support.paths import GPT2, REPO, TINY, needs_shared, require_shared
from tests.support.ray_head import head_env, processes_naming, ray_head
from tests.support.shard_fixtures import tree_bytes
from tests.support.train_helpers import RUN_TIMEOUT_S, write_config
from tests.support.upload_fixtures import CODE, SECRETS, seed_project, uploaded_names

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 2 * RUN_TIMEOUT_S
POLL_S = 0.2  # how often to look for a job's process
PREP_CHARS = 200_000  # several work units and train shards at the sizes below
STOP_GRACE_S = 60
# How often a client refused by the GCS retries, about a second each (Ray's default: 20).
GCS_RETRIES_ENV, GCS_RETRIES = "RAY_NUM_REDIS_GET_RETRIES", 2  # Ray's stop escalates to SIGKILL after a few seconds; allow a slow machine


@pytest.fixture(scope="module")
def head():
    with ray_head() as started:
        yield started


def unmask(args: list[str], *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``unmask ARGS`` as a client of the head: its environment, less the address and auth mode."""
    base = {k: v for k, v in head_env().items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    return run_unmask(args, base_env=base, env=env, timeout=JOB_TIMEOUT_S)


def _run_args(tmp_path: Path, run_dir: Path) -> list[str]:
    require_shared(TINY)
    corpus = tmp_path / "input.txt"
    corpus.write_text(TINY.read_text(encoding="utf-8")[:150_000], encoding="utf-8")
    config = write_config(tmp_path / "micro.yaml", {"train": {"max_steps": 6}})
    return ["run", "--config", str(config), "--input", str(corpus), "--run-dir", str(run_dir), "--seq-len", "64",
            "--vocab-size", "384", "--val-fraction", "0.1", "--samples", "4", "--num-samples", "1",
            "--sample-steps", "8"]


def test_submitted_run_trains_evaluates_and_tracks_in_mlflow(head, mlflow_server, tmp_path):
    run_dir = tmp_path / "run"
    args = _run_args(tmp_path, run_dir)
    submitted = unmask(["submit", "--address", head.dashboard_url, "--working-dir", str(REPO), "--follow", "--",
                        *args, "--mlflow-uri", mlflow_server])
    assert submitted.returncode == 0, submitted.stdout[-4000:] + submitted.stderr[-4000:]
    job_id = submitted.stdout.splitlines()[0].strip()
    assert job_id.startswith("raysubmit_") and "SUCCEEDED" in submitted.stderr
    assert "unmask run: finished" in submitted.stdout  # the streamed job log

    results = json.loads((run_dir / "report" / "results.json").read_text())
    assert results["model"]["step"] == 6 and "val" in results["datasets"]
    assert (run_dir / "report" / "report.html").is_file()
    training = results["training"]
    assert training["untrained_val_nelbo_per_token"] > training["final_val_nelbo_per_token"]
    run = MlflowClient(mlflow_server).get_run(results["mlflow"]["run_id"])
    assert results["mlflow"]["tracking_uri"] == mlflow_server
    assert run.data.metrics["eval/val/nelbo_per_token"] == pytest.approx(results["datasets"]["val"]["nelbo_per_token"])
    assert "train/loss" in run.data.metrics

    listed = unmask(["jobs", "list", "--address", head.dashboard_url])
    assert f"{job_id}\tSUCCEEDED" in listed.stdout, listed.stderr
    status = unmask(["jobs", "status", job_id, "--address", head.dashboard_url])
    assert status.stdout.startswith(f"{job_id}\tSUCCEEDED")
    logs = unmask(["jobs", "logs", job_id, "--address", head.dashboard_url])
    assert "unmask run: finished" in logs.stdout

    # Rerun locally: every stage is up to date and nothing is redone.
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    report_mtime = (run_dir / "report" / "results.json").stat().st_mtime_ns
    again = unmask([*args, "--mlflow-uri", mlflow_server])
    assert again.returncode == 0, again.stderr[-4000:]
    assert "nothing to do" in again.stdout
    for stage in ("train", "export", "eval"):
        assert f"unmask run: stage {stage}: skipped" in again.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == checkpoints
    assert (run_dir / "report" / "results.json").stat().st_mtime_ns == report_mtime


def _cluster_workers(head, name: str) -> set[str]:
    """Names of the head's worker log files that mention ``name`` (Ray names actor logs by class)."""
    logs = head.temp_dir / "session_latest" / "logs"
    return {path.name for path in logs.glob("worker-*.out") if name in path.read_text(errors="replace")}


def test_prep_with_ray_address_runs_on_the_cluster_and_matches_a_local_prep(head, tmp_path):
    require_shared(TINY, GPT2)
    corpus = tmp_path / "input.txt"
    corpus.write_text(TINY.read_text(encoding="utf-8")[:PREP_CHARS], encoding="utf-8")
    args = ["prep", "--input", str(corpus), "--tokenizer", str(GPT2), "--seq-len", "128", "--val-fraction", "0.05",
            "--shard-bytes", str(16 << 10), "--unit-bytes", str(32 << 10), "--no-progress"]
    on_cluster = unmask([*args, "--out", str(tmp_path / "cluster"), "--workers", "2", "--ray-address",
                         head.gcs_address])
    assert on_cluster.returncode == 0, on_cluster.stderr[-4000:]
    local = unmask([*args, "--out", str(tmp_path / "local"), "--workers", "1"])
    assert local.returncode == 0, local.stderr[-4000:]
    assert tree_bytes(tmp_path / "cluster") == tree_bytes(tmp_path / "local")
    assert _cluster_workers(head, "UnitTokenizer")  # the tokenizer actors ran in the head's workers
    # The prep joined the cluster and left it running.
    assert unmask(["jobs", "list", "--address", head.dashboard_url]).returncode == 0


def test_jobs_stop_ends_a_running_job_and_its_processes(head, tmp_path):
    run_dir = tmp_path / "stopped-demo"
    submitted = unmask(["submit", "--address", head.dashboard_url, "--working-dir", str(REPO), "--",
                        "run", "--run-dir", str(run_dir)])
    assert submitted.returncode == 0, submitted.stderr[-4000:]
    job_id = submitted.stdout.splitlines()[0].strip()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not processes_naming(str(run_dir)):  # the job's `unmask run` has started
        assert time.monotonic() < deadline, unmask(["jobs", "logs", job_id, "--address", head.dashboard_url]).stdout
        time.sleep(POLL_S)
    stopped = unmask(["jobs", "stop", job_id, "--address", head.dashboard_url])
    assert stopped.returncode == 0, stopped.stderr[-4000:]
    assert stopped.stdout.strip() == f"{job_id}\tSTOPPED"
    assert unmask(["jobs", "status", job_id, "--address", head.dashboard_url]).stdout.startswith(f"{job_id}\tSTOPPED")
    # Ray ends the job's process group (SIGTERM, then SIGKILL after its grace period).
    deadline = time.monotonic() + STOP_GRACE_S
    while alive := processes_naming(str(run_dir)):
        assert time.monotonic() < deadline, f"still running after the stop: {alive}"
        time.sleep(POLL_S)


def _uploaded_package(head, marker: str) -> Path:
    # session_latest links to the session directory: count each package once.
    packages = {path.parent.resolve()
                for path in head.temp_dir.glob(f"session_*/runtime_resources/working_dir_files/*/{marker}")}
    assert len(packages) == 1, packages
    return packages.pop()


def test_submit_uploads_code_without_data_checkpoints_git_venv_or_secrets(head, tmp_path):
    project = tmp_path / "project"
    files = ["marker_7f3a.txt", "configs/tiny.yaml", "pipeline/x.py", ".git/HEAD", ".venv/bin/python", "runs/a/log",
             "data/train/shard-000000.tar", "shards/b.tar", "out/checkpoints/step-1/model.pt",
             "export/model.safetensors", ".env", ".ssh/id_rsa", ".ray/auth_token"]
    for name in files:
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(name)
    done = unmask(["submit", "--address", head.dashboard_url, "--working-dir", str(project), "--wait",
                   "--env", "UNMASK_TEST=1", "--", "version"])
    assert done.returncode == 0, done.stderr[-4000:]
    package = _uploaded_package(head, "marker_7f3a.txt")
    uploaded = sorted(str(path.relative_to(package)) for path in package.rglob("*") if path.is_file())
    assert uploaded == ["configs/tiny.yaml", "marker_7f3a.txt", "pipeline/x.py"]
    job_id = done.stdout.splitlines()[0].strip()
    assert "unmask " in unmask(["jobs", "logs", job_id, "--address", head.dashboard_url]).stdout


def test_submit_from_a_checkout_uploads_its_code_and_no_secret(head, tmp_path):
    """The package that reaches the head holds exactly the code: no secret (tracked or not,
    by name or by a private key inside), nothing .gitignore'd, nothing linked from outside."""
    project = seed_project(tmp_path / "checkout", tmp_path / "outside", git=True)
    done = unmask(["submit", "--address", head.dashboard_url, "--working-dir", str(project), "--wait", "--",
                   "version"])
    if done.returncode != 0 and done.stdout:  # the job's own log says why
        done.stderr += unmask(["jobs", "logs", done.stdout.split()[0], "--address", head.dashboard_url]).stdout
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"uploading {len(CODE)} files" in done.stderr
    assert f"left out {len(SECRETS)} secret-looking files: .bash_history, .env, " in done.stderr
    package = _uploaded_package(head, "marker_5e2d.txt")
    assert uploaded_names(package) == sorted(CODE)
    assert not [path for path in package.rglob("*") if path.is_symlink()]


def test_token_auth_from_env_or_file_and_a_clear_error_without(head, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    no_token = unmask(["jobs", "list", "--address", head.dashboard_url], env={"HOME": str(home)})
    assert no_token.returncode == 2
    assert "requires a token" in no_token.stderr and "auth_token" in no_token.stderr
    with_env = unmask(["jobs", "list", "--address", head.dashboard_url],
                      env={"HOME": str(home), "RAY_AUTH_TOKEN": token})
    assert with_env.returncode == 0, with_env.stderr[-2000:]


@needs_shared("gpt2-bpe")
def test_prep_joining_a_cluster_without_a_token_says_where_to_find_it(head, tmp_path):
    """Joining the cluster itself (prep --ray-address): Ray alone only says it cannot connect."""
    home = tmp_path / "home"
    home.mkdir()
    corpus = tmp_path / "input.txt"
    corpus.write_text("A document.\n\nAnother one.\n", encoding="utf-8")
    prep = unmask(["prep", "--input", str(corpus), "--tokenizer", str(GPT2), "--seq-len", "8",
                   "--out", str(tmp_path / "out"), "--ray-address", head.gcs_address],
                  env={"HOME": str(home), GCS_RETRIES_ENV: str(GCS_RETRIES)})
    assert prep.returncode == 2
    assert f"--ray-address {head.gcs_address}" in prep.stderr and "auth_token" in prep.stderr


def test_unknown_job_and_missing_address_are_clear_errors(head):
    unknown = unmask(["jobs", "status", "raysubmit_nope", "--address", head.dashboard_url])
    assert unknown.returncode == 2 and "raysubmit_nope" in unknown.stderr
    env = {name: "" for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    missing = unmask(["jobs", "list"], env=env)
    assert missing.returncode == 2 and "--address" in missing.stderr
