"""`unmask sample` checks its --out and its --reference before sampling, each refused in one line
(`unmask eval` takes the same --reference). Its --out may be a FIFO or a device (`>(jq ...)`,
/dev/null), written in place and never replaced; a full disk is one line and leaves no
temporary file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from tests.support.cli_refusals import cli_error as _cli
from tests.support.cli_refusals import one_line_error as _error
from tests.support.cli_runner import unmask_in_process
from tests.support.export_fixtures import EXPORT_LENGTH, EXPORT_VOCAB, LINES, write_untrained_export
from tests.support.full_disk import namespaces_work, run_on_small_disk

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_sample_checks_out_before_sampling(capsys, a_file, tmp_path):
    base = ["sample", str(tmp_path / "run"), "--num", "1", "--steps", "2"]
    assert "is a directory; give a file name" in _cli(capsys, *base, "--out", str(tmp_path))
    assert "cannot write this file" in _cli(capsys, *base, "--out", str(a_file / "s.jsonl"))
    # Not into the export (the next `unmask export` would refuse to replace it).
    export = tmp_path / "export"
    err = _cli(capsys, "sample", str(export), "--num", "1", "--out", str(export / "samples.jsonl"))
    assert f"--out {export / 'samples.jsonl'}: lies inside the export it samples ({export}), which the command " \
           f"reads; choose a --out outside it" in err
    assert not export.exists()


@pytest.mark.parametrize("flag", ["--prompt", "--infill"])
def test_a_text_flag_that_is_not_utf8_is_refused_in_one_line_naming_it(capsys, tmp_path, flag):
    """Latin-1 "café" on the command line (the shell hands Python byte 0xe9 as U+DCE9) was
    a ValueError traceback from the tokenizer, after the export was loaded."""
    err = _error(capsys, "sample", str(tmp_path / "no-export"), "--num", "1", flag, "caf\udce9 [MASK*2]")
    assert err.endswith(f"error: {flag}: byte 0xe9 at character 3 is not UTF-8 text; pass the text in UTF-8 (e.g. "
                        f"convert it with iconv -t UTF-8)")


def test_a_hugging_face_reference_whose_own_code_must_run_is_refused_before_sampling(capsys, tmp_path, text_file):
    reference = tmp_path / "custom-lm"
    reference.mkdir()
    (reference / "config.json").write_text(json.dumps({"model_type": "my_custom_lm", "auto_map": {
        "AutoModelForCausalLM": "modeling_custom.CustomLM"}}))
    (reference / "model.safetensors").write_bytes(b"")
    (reference / "modeling_custom.py").write_text("raise SystemExit('this code ran')\n")
    # The export does not exist: the reference is checked first, so no sample is ever drawn.
    for argv in (["sample", str(tmp_path / "no-export"), "--num", "1"],
                 ["eval", str(tmp_path / "no-export"), "--datasets", str(text_file), "--num-samples", "1"]):
        err = _error(capsys, *argv, "--reference", str(reference))
        assert f"--reference {reference}: model_type 'my_custom_lm' is not a causal LM of transformers" in err
        assert "maps it to the directory's own code (auto_map), which unmask never runs" in err


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """An untrained export of a small network."""
    root = tmp_path_factory.mktemp("sample-export")
    tokenizer = train_sentencepiece(LINES, root / "tok", vocab_size=EXPORT_VOCAB)
    return write_untrained_export(root / "export", tokenizer, root / "tok", max_seq_len=EXPORT_LENGTH)


def _sample(export: Path, out: Path) -> list[str]:
    return ["sample", str(export), "--num", "2", "--steps", "2", "--seq-len", "8", "--out", str(out)]


def test_a_fifo_or_a_device_as_out_is_written_in_place_and_never_replaced(export, tmp_path):
    fifo = tmp_path / "samples.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the other end, as `--out >(jq ...)` holds it
    try:
        assert unmask_in_process(_sample(export, fifo)) == 0
        lines = os.read(reader, 1 << 16).decode().splitlines()
    finally:
        os.close(reader)
    assert len(lines) == 2 and all({"text", "tokens"} <= json.loads(line).keys() for line in lines), lines
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO is still there"
    null = tmp_path / "null"
    null.symlink_to(os.devnull)  # /dev/stdout is such a link; a device itself is never replaced either
    assert unmask_in_process(_sample(export, null)) == 0
    assert null.is_symlink() and stat.S_ISCHR(os.stat(os.devnull).st_mode)


@pytest.mark.slow
@pytest.mark.skipif(not namespaces_work(), reason="unprivileged user and mount namespaces are not available")
def test_a_full_disk_is_one_line_and_leaves_no_temporary_file(export, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "samples.jsonl"
    done = run_on_small_disk(_sample(export, out), disk, "64k", fill=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (f"unmask sample: error: {out}: no space left on device while writing it; "
                                            "it was not created: free space on that disk (or write elsewhere) and "
                                            "rerun the same command")
    assert done.listing == ["filler"], "no temporary file is left"
