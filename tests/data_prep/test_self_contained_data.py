"""A data directory stands on its own: the prep keeps its tokenizer's files in
DATA/tokenizer and the manifest names that copy, so a data directory moved to another directory
or machine trains and exports as it is, whatever --tokenizer the prep was given."""

from __future__ import annotations

import random
import shutil

import pytest

from data_prep.shards.format import Manifest
from data_prep.tokenizer.load import load_tokenizer
from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from pipeline.interchange.export import load_export
from tests.support.cli_runner import run_unmask, unmask_in_process
from tests.support.train_helpers import run_train, write_config

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "far", "away", "over", "hill"]


@pytest.mark.slow
def test_a_data_dir_moved_to_another_machine_trains_and_exports_as_is(tmp_path):
    machine_a = tmp_path / "machine-a"
    machine_a.mkdir()
    rng = random.Random(0)
    paragraphs = [" ".join(rng.choices(WORDS, k=12)) for _ in range(1500)]
    (machine_a / "corpus.txt").write_text("\n\n".join(paragraphs))
    train_sentencepiece(paragraphs, machine_a / "reltok", vocab_size=300)
    # A relative --tokenizer, from the prep's working directory.
    prepped = run_unmask(["prep", "--input", "corpus.txt", "--out", "data", "--tokenizer", "reltok", "--seq-len", "32",
                          "--val-fraction", "0.1", "--no-progress"], cwd=machine_a)
    assert prepped.returncode == 0, prepped.stderr[-3000:]
    data = tmp_path / "machine-b" / "data"
    shutil.move(machine_a / "data", data)
    tokenizer_sha256 = load_tokenizer(machine_a / "reltok").sha256
    shutil.rmtree(machine_a)  # the tokenizer stayed on machine A
    manifest = Manifest.read(data)
    assert manifest.tokenizer["path"] == "tokenizer" and manifest.tokenizer["sha256"] == tokenizer_sha256
    assert load_tokenizer(data / "tokenizer").sha256 == tokenizer_sha256
    config = write_config(tmp_path / "c.yaml", {"train": {"max_steps": 1}, "eval": {"every": 0, "batches": 1}})
    run = run_train(tmp_path / "run", data, config).run_dir  # from another working directory
    assert unmask_in_process(["export", str(run)]) == 0
    assert load_export(run / "export").tokenizer.sha256 == tokenizer_sha256
