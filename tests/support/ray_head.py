"""A real Ray head (``ray start --head``) on 127.0.0.1 for job tests, and its teardown.

The head gets its own temp dir, so the processes it starts can be found (and stopped)
by that path without touching any other Ray on the machine (``ray stop`` would stop
them all).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from common.ray_runtime import AUTH_MODE_ENV, LOCAL_NODE_IP, LOOPBACK_ONLY_ENV
from pipeline.distributed import free_port
from tests.support.cli_runner import DISTRIBUTED_ENV

RAY = Path(sys.executable).parent / "ray"
START_TIMEOUT_S = 180
HEAD_CPUS = 2


@dataclass(frozen=True)
class RayHead:
    dashboard_url: str      # the Jobs API address: what `unmask submit --address` takes
    gcs_address: str        # what `ray.init(address=...)` and `--ray-address` take
    temp_dir: Path


def head_env() -> dict[str, str]:
    """The environment of the head: this venv first on PATH, so jobs run our Python; token
    authentication on, as clusters run it; none of torch.distributed's variables: a training
    in this process removes what it set (``Distributed.unset_variables``, asserted by
    test_init_from), but a test that sets them itself must not hand its port to the head's jobs."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault(*LOOPBACK_ONLY_ENV)
    env.setdefault(AUTH_MODE_ENV, "token")
    return env


def processes_naming(*markers: str) -> list:
    """Live processes other than this one whose command line mentions one of ``markers``."""
    import psutil

    return [process for process in psutil.process_iter(["cmdline", "status"])
            if process.pid != os.getpid() and process.info["status"] != psutil.STATUS_ZOMBIE
            and any(m in part for part in process.info["cmdline"] or () for m in markers)]


def _stop(markers: tuple[str, ...]) -> None:
    """Kill the head's processes: those naming its temp dir or GCS address on their command
    line, and their descendants (agents rename themselves, e.g. ``ray::DashboardAgent``)."""
    import psutil

    for process in processes_naming(*markers):
        try:
            family = [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for member in family:
            try:
                member.kill()
            except psutil.NoSuchProcess:
                pass


@contextmanager
def ray_head() -> Iterator[RayHead]:
    """Start a Ray head bound to 127.0.0.1 with its dashboard (Jobs API); stop it after."""
    # A short path: Ray puts unix sockets under it (107-byte limit).
    temp_dir = Path(tempfile.mkdtemp(prefix="unmask-ray-", dir="/tmp"))
    gcs_port, dashboard_port = free_port(), free_port()
    command = [str(RAY), "start", "--head", "--node-ip-address", LOCAL_NODE_IP, "--port", str(gcs_port),
               "--dashboard-host", LOCAL_NODE_IP, "--dashboard-port", str(dashboard_port),
               "--include-dashboard", "true", "--num-cpus", str(HEAD_CPUS), "--temp-dir", str(temp_dir),
               "--disable-usage-stats",
               # Not Ray's fixed defaults (10001, 52365): another Ray on the machine may hold them.
               "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port())]
    try:
        # The token `ray start` requires: made if missing (on a fresh machine no Ray has made one yet).
        subprocess.run([str(RAY), "get-auth-token", "--generate"], env=head_env(), capture_output=True, check=True,
                       timeout=START_TIMEOUT_S)
        started = subprocess.run(command, env=head_env(), capture_output=True, text=True, timeout=START_TIMEOUT_S)
        if started.returncode != 0:
            raise RuntimeError(f"ray start failed ({started.returncode}):\n{started.stdout}\n{started.stderr}")
        yield RayHead(f"http://{LOCAL_NODE_IP}:{dashboard_port}", f"{LOCAL_NODE_IP}:{gcs_port}", temp_dir)
    finally:
        _stop((str(temp_dir), f"--address={LOCAL_NODE_IP}:{gcs_port}"))
