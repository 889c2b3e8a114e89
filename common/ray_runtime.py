"""Connecting to Ray: a local instance pinned to 127.0.0.1, or a cluster by address.

``ray.init`` replaces the process's SIGTERM handler with one that exits 15 without a word;
``ray_session`` puts the command's own back (``orchestration.interruption``: one line, the
staging removed). The manual: docs/cluster.md#preemption-and-exit-codes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Iterator

from common.errors import UserError

LOCAL_NODE_IP = "127.0.0.1"
# Ray turns a loopback node IP into the machine's routable address unless this is "0"
# (read when ray is imported). A local instance then stays on 127.0.0.1: no traffic
# leaves the machine, and nothing depends on the machine's network setup.
LOOPBACK_ONLY_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Set by Ray in the processes of a Ray job: commands submitted with `unmask submit` join
# the cluster they run on instead of starting a Ray of their own.
JOB_ADDRESS_ENV = "RAY_ADDRESS"
# Ray's token authentication (on by default for clusters started by `ray start`, which writes
# the token to ~/.ray/auth_token on the head): the token itself, or a file holding it.
AUTH_MODE_ENV, AUTH_TOKEN_ENV, AUTH_TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")
TOKEN_FIX = f"copy the head's {DEFAULT_TOKEN_FILE} to this machine, or set {AUTH_TOKEN_ENV}"


def use_token_auth_if_available() -> None:
    """Turn Ray's token authentication on when a token is at hand (before importing ray:
    Ray reads the mode once). An explicit RAY_AUTH_MODE is left alone."""
    if AUTH_MODE_ENV in os.environ:
        return
    token_file = Path(os.environ.get(AUTH_TOKEN_PATH_ENV, DEFAULT_TOKEN_FILE)).expanduser()
    if os.environ.get(AUTH_TOKEN_ENV) or token_file.is_file():
        os.environ[AUTH_MODE_ENV] = "token"


def pin_local_ray_to_loopback() -> None:
    """Call before the first ``import ray`` of a process that starts a local Ray."""
    os.environ.setdefault(*LOOPBACK_ONLY_ENV)


def _cannot_connect(address: str, err: Exception) -> UserError:
    fix = "check the address (HEAD:6379, ray://HEAD:10001 or auto)"
    if os.environ.get(AUTH_MODE_ENV) != "token":  # Ray only says the connection failed
        fix += f"; if the cluster requires a token, {TOKEN_FIX}"
    return UserError(f"--ray-address {address}: cannot connect to Ray ({err}); {fix}")


@contextlib.contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """Around ``ray.init``: the SIGTERM handler it replaces is put back (module docstring).
    Only the main thread has handlers to keep."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, handler)


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None, *,
                log_to_driver: bool = False) -> Iterator[None]:
    """Use the running Ray if this process already joined one; else start or join one.

    ``address=None`` joins the cluster of the Ray job this process belongs to, if any, and
    otherwise starts a local Ray bound to 127.0.0.1 (no dashboard; never one that
    ``ray start`` left running) and shuts it down afterwards. An address
    (``ray://host:10001``, ``host:6379`` or ``auto``) joins a cluster.
    ``log_to_driver`` prints the workers' output here (training logs), off for prep.
    """
    if address is None:
        address = os.environ.get(JOB_ADDRESS_ENV) or None
    if address is None:
        pin_local_ray_to_loopback()
        # Ray's default for a new local instance (token auth on, a token made if missing), said
        # explicitly: left unset, Ray prints a notice about it on every start.
        os.environ.setdefault(AUTH_MODE_ENV, "token")
    else:
        use_token_auth_if_available()
    import ray  # lazily: `unmask version` and friends should not pay for importing Ray

    if ray.is_initialized():
        yield
        return
    kwargs = dict(include_dashboard=False, log_to_driver=log_to_driver, configure_logging=False)
    with _keeping_sigterm_handler():
        if address is None:
            ray.init(address="local", num_cpus=num_cpus, _node_ip_address=LOCAL_NODE_IP, **kwargs)
        else:
            try:
                ray.init(address=address, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise _cannot_connect(address, err) from None
    try:
        yield
    finally:
        ray.shutdown()
