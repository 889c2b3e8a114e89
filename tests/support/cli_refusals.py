"""Commands run to their refusal: the one-line error a mistake must end in (exit 2, no
traceback), and what the tests of those refusals give the commands: a file where a directory
belongs, a text to score, and exports of untrained tiny networks."""

from __future__ import annotations

import subprocess
from pathlib import Path

from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from pipeline.run_dir.layout import RunLayout
from tests.support.cli_runner import run_unmask, unmask_in_process
from tests.support.export_fixtures import write_untrained_export

# The max_seq_len of the untrained exports.
MAX_SEQ_LEN = 64


def one_line_error(capsys, *argv: str) -> str:
    """``unmask ARGV`` must fail with one line (exit 2): that line."""
    assert unmask_in_process(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"unmask {argv[0]}: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def cli_error(capsys, *argv: str) -> str:
    """Run ``unmask ARGV`` in this process; it must fail with a UserError: its message."""
    assert unmask_in_process(argv) == 2
    err = capsys.readouterr().err
    assert f"unmask {argv[0]}: error: " in err
    return err


def installed_cli_error(*argv: str) -> subprocess.CompletedProcess:
    """Run the installed ``unmask ARGV``; it must fail with one message, no traceback."""
    result = run_unmask(argv, installed=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return result


def write_a_file(directory: Path) -> Path:
    """``directory/a-file``: a file, where the commands under test expect a directory."""
    path = directory / "a-file"
    path.write_text("not a directory\n")
    return path


def write_text_file(directory: Path) -> Path:
    """``directory/own.txt``: two short paragraphs, a dataset of the user's own to score."""
    path = directory / "own.txt"
    path.write_text("the cat sat on the mat and said hello\n\nthe dog sat on the log\n")
    return path


def untrained_exports(root: Path) -> dict[str, Path]:
    """Exports of untrained tiny networks over one small tokenizer, in run directories under
    ``root``: "diffusion" and "ar" (the autoregressive baseline), at ``MAX_SEQ_LEN``."""
    lines = [f"the cat {i} sat on the mat {i * 7 % 13} and said hello {i % 5}" for i in range(400)]
    tokenizer = train_sentencepiece(lines, root / "tok", vocab_size=300)
    return {name: write_untrained_export(RunLayout(root / name).export, tokenizer, root / "tok", objective=objective,
                                         max_seq_len=MAX_SEQ_LEN)
            for name, objective in (("diffusion", "diffusion"), ("ar", "autoregressive"))}
