"""A sweep file over tinyshakespeare's shards and the micro training config, to vary per test."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support.train_helpers import write_config

# A single-layer network a few hundred thousand FLOPs per token: a trial is seconds on CPU.
SWEEP = {"budgets": [4e9], "sizes": [{"d_model": 32}], "processes": {"mdlm": {}}, "min_steps": 4,
         "eval_batches": 2, "checkpoints": 2, "max_retries": 1}


@pytest.fixture
def sweep_file(tmp_path, tinyshakespeare_shards):
    """``sweep_file(**fields)``: a sweep file of SWEEP with ``fields`` replaced, on the micro config
    (MLflow off unless ``logging`` says otherwise) and the shards."""
    def write(name: str = "sweep.yaml", logging: dict | None = None, **fields) -> Path:
        config = write_config(tmp_path / f"micro-{name}", {"logging": {"mlflow": False, "every": 50,
                                                                       **(logging or {})}})
        path = tmp_path / name
        path.write_text(yaml.safe_dump({"config": config.name, "data": str(tinyshakespeare_shards),
                                        **SWEEP, **fields}))
        return path
    return write
