"""The run directory claimed around a training (``pipeline.run_dir.claim``): a training that stops
or fails before its first step leaves nothing of the run directory it created (its marker, an
empty lock, the config it resolved). A SIGTERM during start-up is a preemption (exit 75, which
schedulers retry), not a failure (143); a replaced tokenizer is named with what differs. Nothing
is written through a link in the run directory; a linked checkpoints directory is named, and
one inside another run refused."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from data_prep.write_shards import PrepConfig, write_shards
from orchestration.exit_codes import PREEMPTED
from pipeline.distributed import Distributed
from pipeline.run_dir.claim import claimed_run_dir
from tests.support.cli_refusals import one_line_error
from tests.support.cli_runner import cli_env, run_unmask
from tests.support.paths import REPO
from tests.support.shard_fixtures import tree_bytes
from tests.support.train_helpers import write_config

WORDS = ["cat", "dog", "fox", "owl", "sat", "ran", "mat", "log"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A finished prep of a small corpus, with its tokenizer kept in data/tokenizer."""
    root = tmp_path_factory.mktemp("prep")
    corpus = root / "c.txt"
    corpus.write_text("\n\n".join(f"the {w} sat on mat {i}" for i, w in enumerate(WORDS * 30)))
    tokenizer = train_sentencepiece([corpus.read_text()], root / "tok", vocab_size=300)
    write_shards(PrepConfig(inputs=(str(corpus),), seq_len=16, val_fraction=0.1), tokenizer, root / "data",
                 progress=False)
    return root / "data"


@pytest.mark.slow
def test_a_sigterm_during_start_up_exits_75_and_leaves_no_run_directory(data, tmp_path):
    run = tmp_path / "new" / "run"
    config = write_config(tmp_path / "micro.yaml")
    command = [sys.executable, "-m", "tests.support.startup_signal", "train", "--config", str(config), "--data", str(data),
               "--run-dir", str(run)]
    stopped = subprocess.run(command, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert stopped.returncode == PREEMPTED, stopped.stderr[-2000:]
    assert "stopped by SIGTERM outside the training loop" in stopped.stderr and "Traceback" not in stopped.stderr
    assert not (tmp_path / "new").exists(), sorted(p.name for p in run.rglob("*"))


@pytest.mark.slow
def test_a_replaced_tokenizer_is_named_with_what_differs_and_the_failed_run_leaves_nothing(data, tmp_path):
    replaced = tmp_path / "data"
    shutil.copytree(data, replaced)
    other = train_sentencepiece([f"a {w} b {w}{w} {i}" for i, w in enumerate(WORDS * 40)], tmp_path / "other",
                                vocab_size=290)
    shutil.rmtree(replaced / "tokenizer")
    other.save(replaced / "tokenizer")
    run = tmp_path / "new" / "run"
    failed = run_unmask(["train", "--config", str(write_config(tmp_path / "micro.yaml")), "--data", str(replaced),
                         "--run-dir", str(run)])
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
    assert f"{replaced / 'tokenizer'} holds another tokenizer (sha256 {other.sha256[:12]}..., 290 tokens; the " \
           f"manifest records 300): replaced since the prep" in failed.stderr
    assert "not found" not in failed.stderr
    assert not (tmp_path / "new").exists(), sorted(p.name for p in run.rglob("*"))


# ------------------------------------------------------------------ links in the run directory
ALONE = Distributed(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


@pytest.fixture
def mine(data, tmp_path) -> Path:
    """A user's own files: a config and a tokenizer."""
    directory = tmp_path / "mine"
    directory.mkdir()
    (directory / "config.json").write_text('{"my": "config"}')
    shutil.copytree(data / "tokenizer", directory / "tokenizer")
    return directory


def test_training_never_writes_through_a_link_in_its_run_directory(data, mine, tmp_path, capsys):
    """A link where training writes (its config, tokenizer, metrics, lock, MLflow record), or
    `unmask run` (its corpus), is refused before any work: the user's files behind it stay as
    they were."""
    kept = tree_bytes(mine)
    run = tmp_path / "run"
    with claimed_run_dir(run, ALONE, data, []):  # a run directory, marked as one
        pass
    (run / "train.lock").unlink()
    before = sorted(p.name for p in run.iterdir())
    (run / "config.json").symlink_to(mine / "config.json")
    err = one_line_error(capsys, "train", "--config", str(write_config(tmp_path / "micro.yaml")), "--data", str(data),
                         "--run-dir", str(run))
    assert f"--run-dir {run}: config.json is a symbolic link (to {mine / 'config.json'}), and this command writes " \
           f"its own config.json there; it never writes through a link" in err
    (run / "config.json").unlink()
    for name in ("tokenizer", "metrics.jsonl", "train.lock", "mlflow_run.json"):
        (run / name).symlink_to(mine / name)  # the last three point nowhere yet: a write would create them there
        with pytest.raises(UserError, match=rf"{name} is a symbolic link \(to {mine / name}\)"), \
                claimed_run_dir(run, ALONE, data, []):
            pass
        (run / name).unlink()
    (run / "corpus").symlink_to(mine)  # where `unmask run` writes its built-in corpus
    assert f"corpus is a symbolic link (to {mine})" in one_line_error(capsys, "run", "--run-dir", str(run))
    (run / "corpus").unlink()
    assert tree_bytes(mine) == kept and sorted(p.name for p in mine.iterdir()) == ["config.json", "tokenizer"]
    assert sorted(p.name for p in run.iterdir()) == before, "a refused run leaves nothing"


def test_a_linked_checkpoints_directory_is_named_and_never_one_inside_another_run(data, tmp_path, caplog):
    run, bigger_disk = tmp_path / "run", tmp_path / "bigger-disk" / "run-checkpoints"
    run.mkdir()
    bigger_disk.mkdir(parents=True)
    (run / "checkpoints").symlink_to(bigger_disk)
    with caplog.at_level(logging.WARNING, logger="unmask.train"), claimed_run_dir(run, ALONE, data, []):
        pass
    assert f"{run / 'checkpoints'} is a link to {bigger_disk}, outside the run directory: checkpoints are written " \
           "there, and the oldest deleted there" in caplog.text
    other = tmp_path / "other"
    with claimed_run_dir(other, ALONE, data, []):  # another run, marked as one
        (other / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "checkpoints").unlink()
    (run / "checkpoints").symlink_to(other / "checkpoints")
    with pytest.raises(UserError, match=rf"checkpoints is a symbolic link to {other / 'checkpoints'}, inside the "
                                        rf"training run {other}: this run would write its checkpoints among that "
                                        r"run's and delete the oldest"), claimed_run_dir(run, ALONE, data, []):
        pass
    (run / "checkpoints").unlink()
    (run / "checkpoints").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UserError, match="checkpoints is a symbolic link to .*nowhere, which is not a directory"), \
            claimed_run_dir(run, ALONE, data, []):
        pass
    assert (other / "checkpoints" / "step-00000002").is_dir()
