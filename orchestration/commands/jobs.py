"""The ``unmask submit`` and ``unmask jobs`` commands (Ray Jobs API)."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from common.errors import UserError

RAW = argparse.RawDescriptionHelpFormatter

SUBMIT_EPILOG = """\
examples (everything after -- is the unmask command the cluster runs):
  unmask submit --address http://HEAD:8265 -- run --config configs/small.yaml \\
      --input /shared/owt --run-dir /shared/runs/small --launcher ray --num-workers 8 --gpus-per-worker 1
  unmask submit --address http://127.0.0.1:8265 --follow -- run --run-dir /tmp/demo
  unmask submit --env MLFLOW_TRACKING_TOKEN=... --pip 'tokenizers>=0.20' -- prep --input s3://b/c/ ...
  unmask submit --dry-run                      # list the files that would be uploaded, submit nothing

what is uploaded: the files of --working-dir that git lists (tracked, or untracked and not
ignored; every file, minus .gitignore/.rayignore, when it is not a git checkout), without
.git, venvs, runs/, data/, shards/, checkpoints, *.tar, *.pt, *.safetensors, MLflow stores
or --exclude patterns, and never a secret-looking file, even one git tracks: dotenv files
(.env, *.env), .ssh/ .aws/ .gcloud/ .azure/ .kube/ .ray/ and other credential dirs, keys
and keystores (*.pem, *.key, *.p12, id_rsa*), token files (auth_token, .netrc, .pypirc,
.git-credentials), *service-account*.json, *credentials*.json, files holding a private
key, links to outside the directory. Keep a job's secrets on the cluster (or pass them with
--env, readable by anyone who can query the cluster's Jobs API); upload one on purpose with
--include-secret PATTERN. A one-line summary goes to stderr before the upload; over
--max-upload-mb (default %(max_mb)s MiB) nothing is submitted.
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
    from orchestration.cluster.jobs import JobRequest, connect, follow_logs, submit, wait

    command = args.unmask_args[1:] if args.unmask_args[:1] == ["--"] else args.unmask_args
    if args.max_upload_mb is not None and args.max_upload_mb <= 0:
        raise UserError(f"--max-upload-mb {args.max_upload_mb:g}: give a positive size in MiB")
    request = JobRequest(args=tuple(command), working_dir=Path(args.working_dir), env=_env_pairs(args.env),
                         pip=tuple(args.pip), excludes=tuple(args.exclude), include_secrets=tuple(args.include_secret),
                         max_upload_mb=args.max_upload_mb, python=args.python, submission_id=args.job_id,
                         entrypoint_num_gpus=args.gpus)
    plan = request.plan()
    if args.dry_run:
        for name, size in plan.files:
            print(f"{size}\t{name}")
        for name, why in plan.secrets:
            print(f"left out ({why}): {name}", file=sys.stderr)
        for name in plan.outside:
            print(f"left out (link to outside the working dir): {name}", file=sys.stderr)
        for name in plan.allowed:
            print(f"uploaded although secret-looking (--include-secret): {name}", file=sys.stderr)
        print(plan.summary(hint=False), file=sys.stderr)
        plan.check_size(request.max_upload_mb)
        return 0
    if not request.args:
        raise UserError("nothing to submit: give the unmask command after --, e.g. -- run --config ...")
    plan.check_size(request.max_upload_mb)
    print(plan.summary(), file=sys.stderr, flush=True)
    client = connect(args.address)
    job_id = submit(client, request, plan)
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
    from orchestration.cluster.jobs import connect, follow_logs, status, wait

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
    from orchestration.cluster.upload import MAX_UPLOAD_MB

    submit = commands.add_parser(
        "submit", help="run an unmask command on a Ray cluster (Ray Jobs API)",
        description="Submit `unmask ARGS...` as a Ray job: the code of the working directory is "
                    "uploaded (never data, checkpoints, .git, virtual environments or secret-looking "
                    "files such as .env, keys and credentials; see below), and the job id is "
                    "printed. Token-authenticated clusters work when the token is in "
                    "$RAY_AUTH_TOKEN or ~/.ray/auth_token.",
        epilog=SUBMIT_EPILOG % {"max_mb": MAX_UPLOAD_MB}, formatter_class=RAW)
    _add_address(submit)
    submit.add_argument("--working-dir", default=".", help="code to upload (default: the current directory)")
    submit.add_argument("--dry-run", "--list-upload", dest="dry_run", action="store_true",
                        help="print the files that would be uploaded (bytes<TAB>path) and what is left out; "
                             "submit nothing")
    submit.add_argument("--max-upload-mb", type=float, default=MAX_UPLOAD_MB, metavar="N",
                        help=f"refuse to upload more than N MiB (default {MAX_UPLOAD_MB}; Ray's own limit is "
                             f"about 500)")
    submit.add_argument("--include-secret", action="append", default=[], metavar="PATTERN",
                        help="upload secret-looking files matching PATTERN anyway (gitignore syntax, e.g. "
                             "'.env.example'); a job's real secrets belong on the cluster")
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
