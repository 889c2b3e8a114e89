"""The process group (``pipeline.distributed``): a world of one sets the launcher's variables for
itself and removes them at shutdown; a launcher's variables stay."""

from __future__ import annotations

import os

from pipeline.distributed import init_distributed
from tests.support.cli_runner import DISTRIBUTED_ENV


def test_a_lone_process_leaves_no_launcher_variables_behind(monkeypatch):
    """A world of one sets RANK, MASTER_PORT, ... for itself and removes them at shutdown: a Ray
    head or a child started later by the same process would rendezvous on that port."""
    for name in DISTRIBUTED_ENV:
        monkeypatch.delenv(name, raising=False)
    group = init_distributed(deepspeed_backend=False)
    assert (group.rank, group.world_size, os.environ["MASTER_ADDR"]) == (0, 1, "127.0.0.1")
    group.shutdown()
    assert [name for name in DISTRIBUTED_ENV if name in os.environ] == []


def test_a_launchers_variables_stay_after_shutdown(monkeypatch):
    launcher = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    init_distributed(deepspeed_backend=False).shutdown()
    assert {name: os.environ.get(name) for name in launcher} == launcher
