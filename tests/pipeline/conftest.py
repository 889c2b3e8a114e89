"""Fixtures of the pipeline tests shared across their modules: the shards they train on and
the reference runs (``tests.support.reference_runs``), each made once per session."""

import pytest

from tests.support.reference_runs import train_reference_runs


@pytest.fixture(scope="session")
def shards(tinyshakespeare_shards):
    return tinyshakespeare_shards


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory, shards):
    """Uninterrupted 6-step runs, keyed by (world size, ZeRO stage)."""
    return train_reference_runs(tmp_path_factory.mktemp("ref"), shards)
