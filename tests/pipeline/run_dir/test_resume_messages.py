"""What a run says when it cannot go on from its checkpoints: one line, consistent, and a fix
that works when typed (issue 26, items 7, 8 and 15)."""

from __future__ import annotations

import logging
import re
import shlex
import shutil

import pytest
import torch

from common.errors import UserError
from orchestration.cli import build_parser
from pipeline.distributed import Distributed
from pipeline.run_dir.checkpoint import CheckpointManager
from pipeline.run_dir.rank_files import rank_file
from tests.support.cli_runner import unmask_in_process
from tests.support.train_helpers import MICRO_RUN, run_train, write_config

pytestmark = pytest.mark.slow  # a training run (conftest.micro_run) to resume

ALONE = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


@pytest.fixture
def run(micro_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(micro_run, copy)
    return copy


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-64])


def test_the_fix_of_a_broken_checkpoint_is_a_command_that_parses_and_works(run, capsys):
    _truncate(rank_file(run / "checkpoints" / "step-00000002", 0))
    assert unmask_in_process(["export", str(run)]) == 2
    err = capsys.readouterr().err
    assert "cannot export step-00000002" in err and "(truncated or overwritten)" in err
    hint = re.search(r"export the newest intact one: `(unmask [^`]+)`", err)
    assert hint, err
    argv = shlex.split(hint.group(1))[1:]
    assert build_parser().parse_args(argv).checkpoint == 1
    assert unmask_in_process(argv) == 0 and (run / "export" / "model.safetensors").is_file()


def test_with_no_intact_checkpoint_a_run_says_so_once(run, caplog):
    caplog.set_level(logging.WARNING, logger="unmask.checkpoint")
    manager = CheckpointManager(run, ALONE, keep_last=2)
    _truncate(rank_file(run / "checkpoints" / "step-00000002", 0))
    assert manager.newest_intact().name == "step-00000001"
    assert "step-00000002: " in caplog.text and "resuming from step-00000001 instead" in caplog.text
    caplog.clear()
    _truncate(rank_file(run / "checkpoints" / "step-00000001", 0))
    with pytest.raises(UserError, match=r"no intact checkpoint to resume from \(step-00000002: .*; step-00000001: .*\); "
                                        r"restore them, or move the checkpoints away to start over"):
        manager.newest_intact()
    assert caplog.text == "", "a warning said the run would resume, then it refused"


@pytest.mark.slow
def test_a_config_change_that_reshapes_the_network_is_one_line_naming_the_tensor(run, tinyshakespeare_shards, tmp_path):
    config = write_config(tmp_path / "micro.yaml", MICRO_RUN)
    resumed = run_train(run, tinyshakespeare_shards, config, check=False,
                        extra=["--allow-config-change", "--model.d_model", "96", "--train.max_steps", "3"])
    assert resumed.returncode == 2 and "Traceback" not in resumed.output
    errors = [line for line in resumed.output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, resumed.output[-3000:]
    assert re.fullmatch(r"unmask train: error: cannot resume .*step-00000002: the network changed shape "
                        r"\(model.d_model\): \S+ is \[[\d, ]*64[\d, ]*\] in the checkpoint and \[[\d, ]*96[\d, ]*\] in "
                        r"this config. --allow-config-change cannot reshape weights: keep the checkpoint's model "
                        r"section, or train this one in a new --run-dir", errors[0]), errors[0]
