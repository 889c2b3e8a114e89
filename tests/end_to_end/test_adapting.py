"""Adapting a GPT-2 directory as a user does it, every command after the model is saved: prep
with its tokenizer.json, `unmask train --init-from DIR` into block diffusion (annealing), export,
sample, eval (its report naming the source), and a new run from the adapted export; data of
another tokenizer is refused in one line (docs/adapting.md)."""

from __future__ import annotations

import json

import pytest

from pipeline.run_dir.checkpoint import read_state, resolve_checkpoint
from tests.support.causal_lm_fixtures import write_causal_lm
from tests.support.cli_runner import run_unmask
from tests.support.paths import TINY, needs_shared
from tests.support.train_helpers import run_train, write_config

pytestmark = [pytest.mark.slow, needs_shared("corpora/tinyshakespeare/input.txt")]

# The micro config's shape fields unset: the source brings its network whole.
ADAPT = {"model": {"block_size": 8, "n_layers": None, "d_model": None, "n_heads": None}, "adapt": {"anneal_steps": 1},
         "train": {"max_steps": 2}, "eval": {"every": 2, "batches": 1}, "checkpoint": {"every": 2}}


def _ok(args: list[str]) -> str:
    proc = run_unmask(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def gpt2_shards(tmp_path_factory):
    """A tiny random GPT-2 directory and the start of tinyshakespeare prepared with its tokenizer."""
    root = tmp_path_factory.mktemp("gpt2")
    source = write_causal_lm(root / "gpt2", "gpt2")
    (root / "input.txt").write_text(TINY.read_text(encoding="utf-8")[:100_000], encoding="utf-8")
    _ok(["prep", "--input", str(root / "input.txt"), "--tokenizer", str(source / "tokenizer.json"),
         "--seq-len", "64", "--out", str(root / "shards"), "--no-progress"])
    return source, root / "shards"


def test_a_gpt2_directory_is_adapted_and_every_command_reads_the_result(tmp_path, gpt2_shards):
    source, shards = gpt2_shards
    run = run_train(tmp_path / "run", shards, write_config(tmp_path / "adapt.yaml", ADAPT),
                    extra=["--init-from", str(source)])
    record = read_state(resolve_checkpoint(run.run_dir)).init_from
    assert record["kind"] == "hf" and record["family"] == "gpt2"
    assert record["adaptation"]["target"] == "BD3 (block size 8)"
    _ok(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")])
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["network"]["shift"] and exported["network"]["family"]["learned_positions"] == 65
    _ok(["sample", str(tmp_path / "export"), "--num", "2", "--seq-len", "24", "--sampler", "first-hitting",
         "--out", str(tmp_path / "samples.jsonl")])
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 2
    evaluated = _ok(["eval", str(tmp_path / "export"), "--datasets", "val", "--shards", str(shards), "--quick",
                     "--out", str(tmp_path / "eval")])
    assert "perplexity <=" in evaluated
    report = (tmp_path / "eval" / "report.md").read_text(encoding="utf-8")  # it names the source
    for field, value in (("init_from.source", str(source)), ("init_from.family", "gpt2"),
                         ("init_from.sha256", record["sha256"]), ("init_from.adaptation.target", "BD3 (block size 8)")):
        assert f"`{field}` | `{value}`" in report, field
    # A new run from the adapted export: its network whole (shape set as the source's), no second adaptation.
    again = write_config(tmp_path / "again.yaml", {"model": {"block_size": 8, "n_layers": 2, "d_model": 32,
                                                             "n_heads": 4}, "train": {"max_steps": 1},
                                                   "eval": {"every": 1, "batches": 1}, "checkpoint": {"every": 1}})
    resumed = run_train(tmp_path / "again", shards, again, extra=["--init-from", str(tmp_path / "export")])
    assert read_state(resolve_checkpoint(resumed.run_dir)).init_from["kind"] == "export"


def test_data_of_another_tokenizer_is_refused(tmp_path, gpt2_shards, tinyshakespeare_shards):
    source, _ = gpt2_shards
    proc = run_unmask(["train", "--config", str(write_config(tmp_path / "adapt.yaml", ADAPT)), "--data",
                       str(tinyshakespeare_shards), "--run-dir", str(tmp_path / "run"), "--init-from", str(source)])
    assert proc.returncode != 0
    assert "tokenizer" in proc.stderr and "unmask prep --tokenizer" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()
