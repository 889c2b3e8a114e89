"""The ``unmask submit`` and ``unmask jobs`` commands (Ray Jobs API)."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from pipeline.errors import UserError

RAW = argparse.RawDescriptionHelpFormatter

SUBMIT_EPILOG = """\
examples (everything after -- is the unmask command the cluster runs):
  unmask submit --address http://HEAD:8265 -- run --config configs/small.yaml \\
      --input /shared/owt --run-dir /shared/runs/small --launcher ray --num-workers 8 --gpus-per-worker 1
  unmask submit --address http://127.0.0.1:8265 --follow -- run --run-dir /tmp/demo
  unmask submit --env MLFLOW_TRACKING_TOKEN=... --pip 'tokenizers>=0.20' -- prep --input s3://b/c/ ...
"""

JOBS_EPILOG = """\
examples:
  unmask jobs list --address http://HEAD:8265
  unmask jobs logs raysubmit_X3t7... --follow
  unmask jobs stop raysubmit_X3t7...
"""


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def _cmd_submit(args: argparse.Namespace) -> int:
    from orchestration.jobs import JobRequest, connect, follow_logs, submit, wait

    command = args.unmask_args[1:] if args.unmask_args[:1] == ["--"] else args.unmask_args
    request = JobRequest(args=tuple(command), working_dir=Path(args.working_dir), env=_env_pairs(args.env),
                         pip=tuple(args.pip), excludes=tuple(args.exclude), python=args.python,
                         submission_id=args.job_id, entrypoint_num_gpus=args.gpus)
    client = connect(args.address)
    job_id = submit(client, request)
    print(job_id, flush=True)
    if not (args.wait or args.follow):
        print(f"follow it with: unmask jobs logs {job_id} --follow", file=sys.stderr)
        return 0
    if args.follow:
        for chunk in follow_logs(client, job_id):
            print(chunk, end="", flush=True)
    state = wait(client, job_id)
    print(f"job {job_id}: {state}", file=sys.stderr)
    return 0 if state == "SUCCEEDED" else 1


def _started(millis: int | None) -> str:
    if not millis:
        return "-"
    return datetime.datetime.fromtimestamp(millis / 1000).isoformat(sep=" ", timespec="seconds")


def _cmd_jobs(args: argparse.Namespace) -> int:
    from orchestration.jobs import connect, follow_logs, status, wait

    client = connect(args.address)
    if args.jobs_command == "list":
        for job in sorted(client.list_jobs(), key=lambda job: job.start_time or 0):
            command = (job.metadata or {}).get("unmask_command", job.entrypoint)
            print(f"{job.submission_id}\t{job.status.value}\t{_started(job.start_time)}\t{command}")
        return 0
    if args.jobs_command == "status":
        status(client, args.job_id)  # a clear error for an unknown id
        info = client.get_job_info(args.job_id)
        print(f"{args.job_id}\t{info.status.value}\t{info.message or ''}")
        return 0
    if args.jobs_command == "logs":
        if args.follow:
            for chunk in follow_logs(client, args.job_id):
                print(chunk, end="", flush=True)
        else:
            status(client, args.job_id)  # a clear error for an unknown id
            print(client.get_job_logs(args.job_id), end="")
        return 0
    stopped = client.stop_job(args.job_id)
    final = wait(client, args.job_id) if stopped else status(client, args.job_id)
    print(f"{args.job_id}\t{final}")
    return 0


def _add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="the cluster's dashboard URL, e.g. http://HEAD:8265 "
                                          "(default: $RAY_API_SERVER_ADDRESS or $RAY_ADDRESS)")


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``submit`` and ``jobs`` to the ``unmask`` command."""
    submit = commands.add_parser(
        "submit", help="run an unmask command on a Ray cluster (Ray Jobs API)",
        description="Submit `unmask ARGS...` as a Ray job: the working directory is uploaded "
                    "without data, checkpoints, .git or virtual environments, and the job id is "
                    "printed. Token-authenticated clusters work when the token is in "
                    "$RAY_AUTH_TOKEN or ~/.ray/auth_token.",
        epilog=SUBMIT_EPILOG, formatter_class=RAW)
    _add_address(submit)
    submit.add_argument("--working-dir", default=".", help="code to upload (default: the current directory)")
    submit.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="job environment variable")
    submit.add_argument("--pip", action="append", default=[], metavar="REQUIREMENT",
                        help="extra pip requirement installed for the job")
    submit.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                        help="also leave these out of the upload (gitignore syntax)")
    submit.add_argument("--python", default="python", help="the interpreter on the cluster (default python)")
    submit.add_argument("--job-id", help="submission id (default: chosen by Ray)")
    submit.add_argument("--gpus", type=float, default=0.0, help="GPUs reserved for the command itself")
    follow = submit.add_mutually_exclusive_group()
    follow.add_argument("--wait", action="store_true", help="wait for the end; exit 0 only if it succeeded")
    follow.add_argument("--follow", action="store_true", help="stream the job's log until it ends (implies --wait)")
    submit.add_argument("unmask_args", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the unmask command")
    submit.set_defaults(handler=_cmd_submit)

    jobs = commands.add_parser("jobs", help="list, inspect, follow and stop submitted jobs",
                               description="Follow jobs submitted with `unmask submit`.",
                               epilog=JOBS_EPILOG, formatter_class=RAW)
    actions = jobs.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    for name, text in (("list", "every job: id, status, start time, command"),
                       ("status", "a job's status and message"), ("logs", "a job's log"),
                       ("stop", "stop a job and wait until it has stopped")):
        action = actions.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                                    epilog=JOBS_EPILOG, formatter_class=RAW)
        _add_address(action)
        if name != "list":
            action.add_argument("job_id", metavar="JOB", help="the submission id `unmask submit` printed")
        if name == "logs":
            action.add_argument("--follow", action="store_true", help="stream until the job ends")
        action.set_defaults(handler=_cmd_jobs)
