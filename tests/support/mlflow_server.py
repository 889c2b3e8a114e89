"""A real ``mlflow server`` on 127.0.0.1 for tests: a context manager and a session fixture.

Registered for all tests by ``pytest_plugins`` in ``tests/conftest.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

HOST = "127.0.0.1"
MLFLOW = Path(sys.executable).parent / "mlflow"
# Cold start on a 2-core machine takes ~12 s (imports, schema migrations, uvicorn); the
# deadline leaves room for a loaded CI machine without hanging forever on a broken one.
STARTUP_DEADLINE_S = 120.0
POLL_INTERVAL_S = 0.2
HEALTH_TIMEOUT_S = 2.0
SHUTDOWN_GRACE_S = 10.0
LOG_TAIL_CHARS = 4000
# The job runner (huey consumers for MLflow's background jobs) is not needed for
# tracking, slows the start, and its workers outlive the server by a few seconds.
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
# Bypass any http_proxy from the environment: the server is on loopback.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def server_command(root: Path, port: int) -> list[str]:
    """The ``mlflow server`` command line: SQLite store and proxied artifacts under ``root``."""
    return [
        str(MLFLOW), "server",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
        "--host", HOST, "--port", str(port), "--workers", "1",
    ]


def _healthy(url: str) -> bool:
    try:
        with _DIRECT.open(f"{url}/health", timeout=HEALTH_TIMEOUT_S) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-LOG_TAIL_CHARS:]


def _wait_until_healthy(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    while not _healthy(url):
        if process.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {process.returncode}:\n{_log_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"mlflow server not healthy after {STARTUP_DEADLINE_S} s:\n"
                               f"{_log_tail(log)}")
        time.sleep(POLL_INTERVAL_S)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the whole process group (the CLI and its uvicorn child), then SIGKILL it."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=SHUTDOWN_GRACE_S)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    try:  # whatever is still there after the grace period
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


@contextmanager
def running_mlflow_server(root: Path, port: int | None = None) -> Iterator[str]:
    """Start ``mlflow server`` with its store under ``root``, yield its URL
    (``http://127.0.0.1:PORT``) once ``/health`` answers, and stop it afterwards. The same
    ``root`` and ``port`` again restart the same server (an outage and its end)."""
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    url = f"http://{HOST}:{port}"
    log = root / "server.log"
    # A file, not a pipe: nobody reads the server's output while tests run, and a full
    # pipe would block it.
    with open(log, "ab") as sink:
        process = subprocess.Popen(
            server_command(root, port), stdin=subprocess.DEVNULL, stdout=sink,
            stderr=subprocess.STDOUT, env={**os.environ, **SERVER_ENV}, start_new_session=True)
    try:
        _wait_until_healthy(process, url, log)
        yield url
    finally:
        _stop(process)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of one MLflow tracking server shared by the whole test session."""
    with running_mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as url:
        yield url
