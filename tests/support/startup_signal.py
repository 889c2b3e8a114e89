"""A SIGTERM that arrives while a training command starts up, at a known point: after the run
directory is claimed and locked, while the trainer finds the data's tokenizer (before the
training loop installs its own handler). What a scheduler's preemption does to a job that
is still loading.

    python -m tests.support.startup_signal train --data DATA --run-dir RUN ...
"""

from __future__ import annotations

import os
import signal
import sys

import pipeline.training.build
from orchestration.cli import main

_find_tokenizer = pipeline.training.build.find_tokenizer


def _preempted_while_loading(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return _find_tokenizer(*args, **kwargs)


if __name__ == "__main__":
    pipeline.training.build.find_tokenizer = _preempted_while_loading
    sys.exit(main(sys.argv[1:]))
