"""The data commands as users run them: `unmask tokenizer train` and `unmask prep --vocab-size`."""

import json

import pytest

from data_prep.shards.format import Manifest
from data_prep.tokenizer.load import load_tokenizer
from tests.support.cli_runner import run_unmask
from tests.support.paths import GPT2, PTB, TINY, needs_shared

pytestmark = needs_shared(TINY, PTB)


def test_tokenizer_train_writes_a_loadable_round_tripping_tokenizer(tmp_path):
    result = run_unmask(["tokenizer", "train", "--input", str(TINY), "--vocab-size", "400",
                         "--out", str(tmp_path / "tok")], installed=True)
    assert result.returncode == 0, result.stderr
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert tokenizer.kind == "sentencepiece" and tokenizer.vocab_size == 400
    assert tokenizer.sha256[:12] in result.stdout
    text = "ROMEO:\n  But soft! what light through yonder window breaks?\t\u00e9\u4e2d\U0001f600\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_train_refuses_a_bad_vocab_size_by_flag(tmp_path):
    result = run_unmask(["tokenizer", "train", "--input", str(TINY), "--vocab-size", "10",
                         "--out", str(tmp_path / "t")], installed=True)
    assert result.returncode == 2 and "--vocab-size" in result.stderr and "Traceback" not in result.stderr


def test_prep_with_a_vocab_size_trains_then_reuses_its_tokenizer(tmp_path):
    out = tmp_path / "shards"
    args = ("prep", "--input", str(PTB), "--text-format", "lines", "--out", str(out), "--seq-len", "64",
            "--vocab-size", "500", "--no-progress", "--json")
    first = run_unmask(args, installed=True)
    assert first.returncode == 0, first.stderr
    manifest = Manifest.read(out)
    assert manifest.tokenizer["kind"] == "sentencepiece" and manifest.tokenizer["vocab_size"] == 500
    assert manifest.tokenizer["sha256"] == load_tokenizer(out / "tokenizer").sha256
    assert manifest.counts["documents"] == 3761  # PTB test: one sentence per line
    second = run_unmask(args, installed=True)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout.strip().splitlines()[-1])["nothing_to_do"] is True


@pytest.mark.parametrize("source", [["--vocab-size", "500"], ["--tokenizer", str(GPT2)]])
def test_prep_refuses_special_token_flags_for_tokenizers_that_fix_their_own(tmp_path, source):
    result = run_unmask(["prep", "--input", str(PTB), "--out", str(tmp_path / "o"), "--seq-len", "64", *source,
                         "--eos-token", "</s>", "--pad-token", "<pad>"], installed=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--eos-token, --pad-token" in result.stderr
    assert not (tmp_path / "o" / "tokenizer").exists()  # refused before any training


def test_cli_prints_errors_without_a_traceback(tmp_path):
    result = run_unmask(["prep", "--input", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o"),
                         "--seq-len", "16", "--tokenizer", str(GPT2)], installed=True)
    assert result.returncode == 2
    assert "unmask prep: error:" in result.stderr and "nope.txt" in result.stderr
    assert "Traceback" not in result.stderr
    assert run_unmask(["prep", "--help"], installed=True).returncode == 0
