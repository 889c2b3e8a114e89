"""Console logging for every ``unmask`` command and every process of a run."""

from __future__ import annotations

import logging
import os

__all__ = ["configure_logging"]

LOG_FORMAT = "%(asctime)s %(name)s: %(message)s"
TIME_FORMAT = "%H:%M:%S"
DEEPSPEED_ACCELERATOR_ENV = "DS_ACCELERATOR"


def configure_logging() -> None:
    """INFO logs with times for our loggers; DeepSpeed's at WARNING (it logs its whole
    config at INFO). Idempotent: a process (a Ray Train worker, `unmask run`) may call it
    once per stage."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt=TIME_FORMAT)
    import torch

    if not torch.cuda.is_available():
        # DeepSpeed warns on every import that it "falls back" to the CPU when it detects no
        # GPU; on a machine without one that is the plan, so say it instead of detecting.
        os.environ.setdefault(DEEPSPEED_ACCELERATOR_ENV, "cpu")
    try:
        from deepspeed.utils import logger as deepspeed_logger
    except ImportError:
        return
    deepspeed_logger.setLevel(logging.WARNING)
