"""The exit status of every ``unmask`` command: what shells and schedulers read."""

from __future__ import annotations

__all__ = ["INTERRUPTED", "OK", "PREEMPTED", "PREEMPTED_NAME", "TERMINATED", "USER_ERROR"]

OK = 0
# A mistake the user can fix (common.errors.UserError): the message says which; argparse's own.
USER_ERROR = 2
# A run stopped by SIGTERM or SIGINT that wrote its checkpoint: neither finished nor failed.
# 75 is sysexits.h's EX_TEMPFAIL ("temporary failure, the user is invited to retry"), which is
# what a preempted run is. Non-zero, so that Ray, Kubernetes and SLURM do not mark the job
# done and their restart policies run it again (it resumes from the checkpoint); and not 1,
# so that a policy can tell a preemption from a failure (Kubernetes' podFailurePolicy
# onExitCodes, SLURM's requeue scripts).
PREEMPTED = 75  # os.EX_TEMPFAIL
PREEMPTED_NAME = "EX_TEMPFAIL"
# A command stopped by a signal outside the training loop (orchestration.interruption): what a
# shell reports for a process the signal ends, 128 + the signal's number (SIGINT 2, SIGTERM 15).
INTERRUPTED = 130
TERMINATED = 143
