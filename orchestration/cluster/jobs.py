"""Ray Jobs: submit any ``unmask`` command to a cluster, then list, follow and stop it.

A job runs ``python -m orchestration.cli ARGS`` on the head node in a copy of the working
directory: the project's code and configs. Which files go is decided here, not by Ray
(``orchestration.cluster.upload``): the files git lists in a checkout (so ``.gitignore`` holds),
never data, checkpoints, ``.git`` or a virtual environment (``EXCLUDES``), never a file that
looks like a secret (``SECRET_PATTERNS``: dotenv files, SSH/cloud credentials, keys, tokens),
and at most ``MAX_UPLOAD_MB``; exactly those files are zipped and the zip is what Ray
uploads. Paths in ARGS are read on the cluster, so data and run directories should live on
storage the cluster sees (a shared filesystem or a URI).

Clusters that require a token (Ray's default since 2.52) are reached with the token in
``RAY_AUTH_TOKEN``, in ``RAY_AUTH_TOKEN_PATH`` or in ``~/.ray/auth_token`` (where ``ray
start`` writes it on the head): ``common.ray_runtime.use_token_auth_if_available``
turns Ray's token mode on when one of them is there.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from common.errors import UserError
from common.ray_runtime import TOKEN_FIX, use_token_auth_if_available
from orchestration.cluster.upload import (
    EXCLUDES,
    MAX_UPLOAD_MB,
    SECRET_PATTERNS,
    UploadPlan,
    plan_upload,
    write_package,
)

__all__ = ["JobRequest", "EXCLUDES", "SECRET_PATTERNS", "MAX_UPLOAD_MB", "connect", "submit", "wait",
           "TERMINAL_STATUSES", "ADDRESS_ENV"]

# Where the address comes from when --address is not given (the Ray CLI's variables).
ADDRESS_ENV = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
POLL_SECONDS = 1.0  # status polling while waiting: one cheap HTTP request per second
# The Jobs API's answer while the head's job agent is still starting, and how long to wait for it.
NO_AGENT_YET = "No available agent to submit job"
AGENT_WAIT_S = 120.0


def resolve_address(address: str | None) -> str:
    """``--address`` or the Ray CLI's environment variables; a clear error when none."""
    for name in ADDRESS_ENV:
        address = address or os.environ.get(name)
    if not address:
        raise UserError("--address is required (the Ray dashboard, e.g. http://HEAD:8265), "
                        f"or set {ADDRESS_ENV[0]}")
    return address


def connect(address: str | None):
    """A ``JobSubmissionClient`` for the cluster at ``address`` (its dashboard URL)."""
    use_token_auth_if_available()
    address = resolve_address(address)
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except AuthenticationError:
        raise UserError(f"--address {address}: the cluster requires a token: {TOKEN_FIX}") from None
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise UserError(f"--address {address}: cannot reach the Ray Jobs API ({err}); give the "
                        f"dashboard URL, e.g. http://HEAD:8265") from None


@dataclass(frozen=True)
class JobRequest:
    """One ``unmask`` command to run as a Ray job, and the environment it runs in."""

    args: tuple[str, ...]                     # the unmask command line, e.g. ("run", "--config", ...)
    working_dir: Path = Path(".")
    env: dict[str, str] = field(default_factory=dict)
    pip: tuple[str, ...] = ()                 # extra requirements, installed by Ray for the job
    excludes: tuple[str, ...] = ()            # more gitignore-style patterns to leave out
    include_secrets: tuple[str, ...] = ()     # secret-looking files to upload anyway (explicit opt-in)
    max_upload_mb: float | None = MAX_UPLOAD_MB  # refuse a bigger upload; None: no limit of ours
    python: str = "python"                    # the interpreter on the cluster
    submission_id: str | None = None
    entrypoint_num_gpus: float = 0.0

    def entrypoint(self) -> str:
        return shlex.join([self.python, "-m", "orchestration.cli", *self.args])

    def plan(self) -> UploadPlan:
        """The files that will be uploaded (see ``orchestration.cluster.upload.plan_upload``)."""
        return plan_upload(self.working_dir, self.excludes, self.include_secrets)

    def runtime_env(self, package: Path) -> dict:
        """The job's runtime env; ``package`` is the zip ``write_package`` made of the plan."""
        env: dict = {"working_dir": str(package)}
        if self.env:
            env["env_vars"] = dict(self.env)
        if self.pip:
            env["pip"] = list(self.pip)
        return env


def submit(client, request: JobRequest, plan: UploadPlan | None = None) -> str:
    """Submit ``request``; its submission id. Uploads exactly ``plan.files`` (default:
    ``request.plan()``), zipped, after checking the size limit. A head that has just started
    has no job agent for a few seconds: that answer is retried for up to ``AGENT_WAIT_S``."""
    if not request.args:
        raise UserError("nothing to submit: give the unmask command after --, e.g. -- run --config ...")
    plan = plan or request.plan()
    plan.check_size(request.max_upload_mb)
    with tempfile.TemporaryDirectory(prefix="unmask-upload-") as scratch:
        # A local .zip is sent to the cluster as is; Ray applies no excludes of its own to it.
        runtime_env = request.runtime_env(write_package(plan, Path(scratch) / "working_dir.zip"))
        deadline = time.monotonic() + AGENT_WAIT_S
        while True:
            try:
                return client.submit_job(entrypoint=request.entrypoint(), runtime_env=dict(runtime_env),
                                         submission_id=request.submission_id,
                                         entrypoint_num_gpus=request.entrypoint_num_gpus or None,
                                         metadata={"unmask_command": shlex.join(request.args)})
            except RuntimeError as err:
                if NO_AGENT_YET not in str(err) or time.monotonic() > deadline:
                    raise UserError(f"the cluster refused the job: {err}") from None
            time.sleep(POLL_SECONDS)


def status(client, job_id: str) -> str:
    """The job's status name (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED)."""
    try:
        return str(client.get_job_status(job_id).value)
    except RuntimeError as err:
        raise UserError(f"job {job_id}: {err}") from None


def follow_logs(client, job_id: str) -> Iterator[str]:
    """The job's log, streamed as it is written, until the job ends."""
    stream = client.tail_job_logs(job_id)
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(stream.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.close()


def wait(client, job_id: str, timeout_s: float | None = None) -> str:
    """Block until the job ends (or ``timeout_s`` passes); its final status."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while (state := status(client, job_id)) not in TERMINAL_STATUSES:
        if deadline is not None and time.monotonic() > deadline:
            raise UserError(f"job {job_id} is still {state} after {timeout_s:.0f} s")
        time.sleep(POLL_SECONDS)
    return state
