"""``unmask prep`` as one call (``data_prep.prep``). What it tells the user about the input it was
given: documents repaired or skipped are counted with the flag that changes it, and loudly when
they are many; a sequence length beyond any model, a split that is mostly padding, and an input
without a document are not passed over in silence; a full disk is one line saying what a rerun
resumes from. And the data directory it writes stands on its own: it keeps a copy of its
tokenizer, so it trains and exports wherever it is moved."""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest

from common.errors import UserError
from data_prep.shards.format import Manifest
from data_prep.tokenizer.load import load_tokenizer
from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from data_prep.write_shards import LOUD_SHARE, MAX_SEQ_LEN, PrepConfig
from pipeline.interchange.export import load_export
from tests.support.cli_refusals import cli_error as _cli
from tests.support.cli_refusals import installed_cli_error as _unmask
from tests.support.cli_refusals import write_a_file
from tests.support.cli_runner import run_unmask, unmask_in_process
from tests.support.full_disk import namespaces_work, run_on_small_disk
from tests.support.paths import GPT2, needs_shared
from tests.support.train_helpers import run_train, write_config

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "far", "away", "caf\u00e9", "na\u00efve"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    train_sentencepiece([" ".join(WORDS)] * 50, root / "tok", vocab_size=300)
    return root / "tok"


def _paragraphs(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=10)) for _ in range(count)]


def _prep(capsys, corpus, out, tokenizer, *flags: str) -> tuple[int, str]:
    status = unmask_in_process(["prep", "--input", str(corpus), "--out", str(out), "--tokenizer", str(tokenizer),
                                "--seq-len", "16", "--no-progress", *flags])
    return status, capsys.readouterr().err


def test_latin1_input_is_reported_loudly_and_with_the_flag(tmp_path, tokenizer, capsys):
    corpus = tmp_path / "latin1.txt"
    corpus.write_bytes("\n\n".join(p + " caf\u00e9" for p in _paragraphs(200)).encode("latin-1"))
    documents = 200
    status, err = _prep(capsys, corpus, tmp_path / "out", tokenizer)
    assert status == 0
    assert (f"unmask prep: warning: 100.0% of the documents ({documents} of {documents}) held invalid UTF-8, "
            f"repaired with U+FFFD (--bad-utf8 replace; --bad-utf8 skip leaves them out); if the input is in another "
            f"encoding (Latin-1, say), convert it: iconv -f LATIN1 -t UTF-8 IN > OUT") in err
    status, err = _prep(capsys, corpus, tmp_path / "skipped", tokenizer, "--bad-utf8", "skip")
    assert status == 2 and f"no documents to prepare (documents: {documents} skipped for invalid UTF-8 " \
                           f"(--bad-utf8 skip))" in err
    assert not (tmp_path / "skipped").exists()


def test_a_few_repaired_documents_are_counted_without_alarm(tmp_path, tokenizer, capsys):
    paragraphs = [p.replace("caf\u00e9", "cafe").replace("na\u00efve", "naive") for p in _paragraphs(300)]
    corpus = tmp_path / "mostly-utf8.txt"
    corpus.write_bytes("\n\n".join(paragraphs).encode() + b"\n\none bad byte \xff here")
    assert 1 / 301 <= LOUD_SHARE
    status, err = _prep(capsys, corpus, tmp_path / "out", tokenizer)
    assert status == 0 and "warning" not in err
    assert "unmask prep: note: 1 of 301 documents held invalid UTF-8, repaired with U+FFFD (--bad-utf8 replace" in err


def test_a_sequence_length_beyond_any_model_is_refused_before_any_work(tmp_path, tokenizer, capsys):
    with pytest.raises(UserError,
                       match=rf"--seq-len must lie in \[2, {MAX_SEQ_LEN}\] \(data_prep.write_shards.MAX_SEQ_LEN"):
        PrepConfig(inputs=("corpus.txt",), seq_len=1_000_000_000)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(_paragraphs(20)))
    status, err = _prep(capsys, corpus, tmp_path / "out", tokenizer, "--seq-len", "1000000000")
    assert status == 2 and "--seq-len must lie in" in err and not (tmp_path / "out").exists()


def test_a_split_that_is_mostly_padding_is_warned_about(tmp_path, tokenizer, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(_paragraphs(20)))
    status, err = _prep(capsys, corpus, tmp_path / "out", tokenizer, "--seq-len", "4096", "--val-fraction", "0")
    train = Manifest.read(tmp_path / "out").splits["train"]
    assert status == 0 and train.sequences == 1
    assert (f"unmask prep: warning: split train: {train.padding_tokens:,} of its 4,096 token slots "
            f"({train.padding_tokens / 4096:.0%}) are padding: --seq-len 4096 is long for its {train.tokens:,} tokens; "
            f"lower --seq-len, or give more text") in err


def test_an_input_without_a_document_is_an_error(tmp_path, tokenizer, capsys):
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n   \n\n\t\n")
    status, err = _prep(capsys, blank, tmp_path / "out", tokenizer)
    assert status == 2 and f"--input {blank}: no documents to prepare (documents: none found)" in err
    assert not (tmp_path / "out").exists()


def test_utf16_input_is_named_with_how_to_convert_it_whether_the_tokenizer_is_given_or_trained(tmp_path, tokenizer,
                                                                                                capsys):
    """A tokenizer to train said "the corpus has no text: 0 documents"; a given one did not
    name the file or its encoding."""
    corpus = tmp_path / "u16.txt"
    corpus.write_bytes("\n\n".join(_paragraphs(50)).encode("utf-16"))
    fix = (f"1 file(s) skipped as binary ({corpus}: UTF-16 text (byte-order mark), not UTF-8): leave them out, or "
           f"convert UTF-16 text to UTF-8 (iconv -f UTF-16 -t UTF-8 IN > OUT.txt)")
    out = str(tmp_path / "out")
    for argv in (["prep", "--out", out, "--seq-len", "16", "--no-progress", "--tokenizer", str(tokenizer)],
                 ["prep", "--out", out, "--seq-len", "16", "--no-progress", "--vocab-size", "300"],
                 ["tokenizer", "train", "--out", out, "--vocab-size", "300"]):
        assert unmask_in_process([*argv, "--input", str(corpus)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(fix) and "\n" not in err, err
    assert not (tmp_path / "out").exists()


PARAGRAPH_WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "far", "away", "over", "hill"]


# ------------------------------------------------------------------ a self-contained data directory
@pytest.mark.slow
def test_a_data_dir_moved_to_another_machine_trains_and_exports_as_is(tmp_path):
    machine_a = tmp_path / "machine-a"
    machine_a.mkdir()
    rng = random.Random(0)
    paragraphs = [" ".join(rng.choices(PARAGRAPH_WORDS, k=12)) for _ in range(1500)]
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


@pytest.fixture
def a_file(tmp_path) -> Path:
    return write_a_file(tmp_path)


# ------------------------------------------------------------------ flags checked before any work
@needs_shared(GPT2)
def test_prep_refuses_an_out_that_is_a_file_before_any_work(a_file, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text\n")
    result = _unmask("prep", "--input", str(corpus), "--out", str(a_file), "--seq-len", "16", "--tokenizer", str(GPT2))
    assert f"--out {a_file}: is a file, not a directory" in result.stderr


def test_prep_and_tokenizer_train_check_out_and_workers_before_training_a_tokenizer(capsys, a_file, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text\n" * 50)
    assert "is a file" in _cli(capsys, "prep", "--input", str(corpus), "--out", str(a_file), "--seq-len", "16",
                               "--vocab-size", "300")
    assert "is a file" in _cli(capsys, "tokenizer", "train", "--input", str(corpus), "--out", str(a_file),
                               "--vocab-size", "300")
    out = tmp_path / "out"
    assert "--workers must be >= 1" in _cli(capsys, "prep", "--input", str(corpus), "--out", str(out),
                                            "--seq-len", "16", "--vocab-size", "300", "--workers", "0")
    assert not (out / "tokenizer").exists(), "the tokenizer was trained before the flags were checked"


@pytest.mark.slow
@pytest.mark.skipif(not namespaces_work(), reason="unprivileged user and mount namespaces are not available")
def test_a_full_disk_is_one_line_saying_what_a_rerun_resumes_from(tmp_path, tokenizer):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(_paragraphs(4000)))  # about 260 KB of text, tokens for a few dozen KB
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "data"
    done = run_on_small_disk(["prep", "--input", str(corpus), "--out", str(out), "--seq-len", "16", "--tokenizer",
                              str(tokenizer), "--unit-bytes", "20000", "--no-progress"], disk, "48k")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"unmask prep: error: --out {out}: no space left on device while writing the prep; the ")
    assert re.search(r"the \d+ units and shards it finished are kept in .*\.prep-work, and rerunning the same command "
                     r"resumes from them: free space on that disk \(or give another --out\) and rerun$", last), last
