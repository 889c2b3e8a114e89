"""Running ``unmask`` as the tests do.

In a subprocess, as a user starts it: ``python -m orchestration.cli`` from this checkout (or,
with ``installed=True``, the console script installed next to this Python), under torchrun for
a world of several processes, with ``stall_after`` through ``tests.support.stall`` (every training
run stalls after that step), and with ``log_batches`` through ``tests.support.batch_log`` (every
micro-batch's sequences are logged). ``run_unmask`` runs it to its end, ``start_unmask`` starts it.

In this process: ``unmask_in_process``, where an escaped exception fails the test just as a
traceback would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.support.paths import REPO

# A command longer than this is stuck: fail instead of hanging the suite.
CLI_TIMEOUT_S = 600
# Set by torchrun: a subprocess must not inherit them from a distributed parent.
DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def cli_env(extra: Mapping[str, str] | None = None, *, base: Mapping[str, str] | None = None,
            pythonpath: bool = True) -> dict[str, str]:
    """The environment of a subprocess: ``base`` (default this process's) without
    torch.distributed's variables, one OpenMP thread per process (the cores are shared),
    the checkout on PYTHONPATH (unless ``pythonpath`` is false), then ``extra``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in DISTRIBUTED_ENV}
    env["OMP_NUM_THREADS"] = "1"
    if pythonpath:
        env["PYTHONPATH"] = str(REPO)
    env.update(extra or {})
    return env


def console_script() -> str:
    """The installed ``unmask`` console script next to this Python."""
    script = shutil.which("unmask", path=str(Path(sys.executable).parent))
    assert script, "the unmask console script is not installed next to this Python"
    return script


def unmask_command(args: Sequence[str], *, world_size: int = 1, stall_after: int | None = None,
                   installed: bool = False, log_batches: bool = False) -> list[str]:
    """The command line of ``unmask ARGS``: one process, or ``world_size`` under torchrun
    (rendezvous on 127.0.0.1); with ``stall_after``, through ``tests.support.stall``; with
    ``log_batches``, through ``tests.support.batch_log``."""
    if installed:
        assert world_size == 1 and stall_after is None and not log_batches, \
            "the console script runs alone, never stalls and logs no batches"
        return [console_script(), *args]
    assert stall_after is None or not log_batches, "one hook at a time"
    module = (["tests.support.stall", str(stall_after), "--"] if stall_after is not None
              else ["tests.support.batch_log"] if log_batches else ["orchestration.cli"])
    if world_size == 1:
        return [sys.executable, "-m", *module, *args]
    from pipeline.distributed import free_port

    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world_size}", "--nnodes=1",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", *module, *args]


def run_unmask(args: Sequence[str], *, env: Mapping[str, str] | None = None,
               base_env: Mapping[str, str] | None = None, cwd: Path = REPO, timeout: float = CLI_TIMEOUT_S,
               world_size: int = 1, stall_after: int | None = None, installed: bool = False,
               log_batches: bool = False) -> subprocess.CompletedProcess:
    """Run ``unmask ARGS`` to its end in a subprocess (environment: ``cli_env(env, base=base_env)``);
    its stdout and stderr are captured as text."""
    command = unmask_command(args, world_size=world_size, stall_after=stall_after, installed=installed,
                             log_batches=log_batches)
    return subprocess.run(command, cwd=cwd, env=cli_env(env, base=base_env, pythonpath=not installed),
                          capture_output=True, text=True, timeout=timeout)


def start_unmask(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path = REPO,
                 world_size: int = 1, stall_after: int | None = None, installed: bool = False,
                 **popen) -> subprocess.Popen:
    """Start ``unmask ARGS`` in a subprocess; by default its stdout and stderr are one text pipe
    (``popen`` passes anything else to ``subprocess.Popen``)."""
    command = unmask_command(args, world_size=world_size, stall_after=stall_after, installed=installed)
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, **popen}
    return subprocess.Popen(command, cwd=cwd, env=cli_env(env, pythonpath=not installed), **popen)


def unmask_in_process(argv: Sequence[str], **kwargs) -> int:
    """Run ``unmask ARGV`` in this process (``orchestration.cli.main``); its exit status."""
    from orchestration.cli import main

    return main(list(argv), **kwargs)
