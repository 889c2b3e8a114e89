"""SIGTERM and SIGINT outside the training loop (``orchestration.interruption``): one line, exit 75
for a training command's SIGTERM, 130 for SIGINT, 143 for another command's SIGTERM, and nothing
staged left behind. The handlers are in place before the command line imports anything heavy.
Each signal is raised at a known point of the command (a patched function raises it), never
after a pause. What a SIGTERM during a training's start-up leaves of its run directory:
``tests/pipeline/run_dir/test_claim.py``."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline.interchange.export as export_module
from data_prep.tokenize_stage import UnitTokenizer
from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from evaluation import zero_shot
from orchestration.exit_codes import INTERRUPTED, PREEMPTED, TERMINATED
from tests.support.cli_runner import cli_env, unmask_in_process
from tests.support.mdlm_reference import DiTShape, random_weights, write_hugging_face
from tests.support.paths import REPO

WORDS = ["cat", "dog", "fox", "owl", "sat", "ran", "mat", "log"]


def test_the_handlers_are_in_place_before_the_cli_imports_anything_heavy():
    """The first import of ``orchestration.cli`` installs them, in the unmask command's own process,
    for every command (the CLI's other imports take seconds: torch)."""
    probe = ("import signal, sys; sys.argv = [{program!r}, *{args!r}]; import orchestration.interruption; "
             "print(*(getattr(signal.getsignal(s), '__name__', 'default') for s in (signal.SIGTERM, signal.SIGINT)),"
             " 'torch' in sys.modules)")
    for program, args, installed in (("/venv/bin/unmask", ["train", "--config", "c.yaml"], "_stop"),
                                     ("/repo/orchestration/cli.py", ["run"], "_stop"),
                                     ("/venv/bin/unmask", ["eval", "runs/x"], "_stop"),
                                     ("/venv/bin/pytest", ["-k", "train"], None)):
        out = _probe(probe.format(program=program, args=args), sigint=signal.SIG_DFL)
        assert out[-1] == "False", (program, out)
        if installed:
            assert out[:2] == [installed, installed], (program, args, out)
        else:  # not the unmask command: Python's own
            assert out[:2] == ["default", "default_int_handler"], (program, out)
    # Started to ignore SIGINT (a shell's background job): it stays ignored, as Python leaves it.
    ignored = _probe(probe.format(program="/venv/bin/unmask", args=["train"]), sigint=signal.SIG_IGN)
    assert ignored[:2] == ["_stop", "default"], ignored


def _probe(code: str, *, sigint: signal.Handlers) -> list[str]:
    """What ``python -c CODE`` prints, words split, started with SIGINT's disposition ``sigint``
    (whatever the disposition of the suite's own process)."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          check=True, preexec_fn=lambda: signal.signal(signal.SIGINT, sigint)).stdout.split()


# The console script's code, with the signal raised when the command line's imports reach torch.
SIGNAL_WHILE_IMPORTING = """
import importlib.abc, signal, sys

class RaiseOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            signal.raise_signal(signal.{signal})
        return None

sys.meta_path.insert(0, RaiseOnImport())
sys.argv = ["unmask", *{args!r}]
from orchestration.cli import main
sys.exit(main())
"""


@pytest.mark.parametrize("args, stop, status", [
    (["train", "--config", "c.yaml", "--data", "d", "--run-dir", "r"], "SIGTERM", PREEMPTED),
    (["export", "runs/x"], "SIGTERM", TERMINATED),
    (["eval", "runs/x"], "SIGINT", INTERRUPTED),
])
def test_a_signal_while_the_command_line_imports_ends_it_in_one_line(args, stop, status):
    done = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_IMPORTING.format(signal=stop, args=args)], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=120, check=False,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stderr == f"unmask {args[0]}: stopped by {stop} while starting (nothing was done yet); rerun the " \
                          "command\n"


@pytest.fixture(autouse=True)
def _sigint_as_from_a_terminal():
    """The commands run in this process see SIGINT as a command started from a terminal does,
    whatever the suite's own process was given (a shell's background job ignores it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _raise_after(monkeypatch, owner: object, name: str, stop: signal.Signals) -> None:
    """``owner.name`` (a module's function, a class's method) runs, then ``stop`` is raised in this process."""
    original = getattr(owner, name)

    def then_stop(*args, **kwargs):
        result = original(*args, **kwargs)
        signal.raise_signal(stop)
        return result

    monkeypatch.setattr(owner, name, then_stop)


def _stopped(capsys, argv: list, status: int, stop: signal.Signals) -> None:
    """``unmask ARGV`` in this process ends with ``status`` and its one line, no traceback."""
    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    assert unmask_in_process([str(a) for a in argv]) == status
    err = capsys.readouterr().err
    assert err.endswith(f"unmask {argv[0]}: stopped by {stop.name}; what it was writing is removed and finished "
                        "work is kept: rerun the same command to go on\n"), err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before, "handlers put back"


def _hidden(directory: Path) -> list[str]:
    """What a command leaves in ``directory`` while it writes: staging siblings, write checks, temporaries."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".") and p.name != ".unmask-output.json")


@pytest.fixture
def run(micro_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(micro_run, copy)
    return copy


@pytest.mark.parametrize("stop, status", [(signal.SIGTERM, TERMINATED), (signal.SIGINT, INTERRUPTED)])
def test_an_interrupted_export_removes_what_it_staged(run, capsys, monkeypatch, stop, status):
    _raise_after(monkeypatch, export_module, "save_file", stop)  # once the weights are in the staging directory
    _stopped(capsys, ["export", run], status, stop)
    assert not (run / "export").exists() and _hidden(run) == []


@pytest.fixture(scope="module")
def mdlm_model(tmp_path_factory) -> tuple[Path, Path]:
    """A small MDLM Hugging Face directory and its tokenizer."""
    root = tmp_path_factory.mktemp("mdlm")
    lines = [f"the {WORDS[i % 8]} {WORDS[i * 3 % 8]} on mat {i}" for i in range(200)]
    tokenizer = train_sentencepiece(lines, root / "tok", vocab_size=300)
    shape = DiTShape(vocab_size=tokenizer.vocab_size)
    return write_hugging_face(root / "mdlm", random_weights(shape, seed=0), shape), root / "tok"


def test_an_interrupted_import_removes_what_it_staged(mdlm_model, tmp_path, capsys, monkeypatch):
    source, tokenizer = mdlm_model
    _raise_after(monkeypatch, export_module, "save_file", signal.SIGINT)
    _stopped(capsys, ["import", "mdlm", source, "--tokenizer", tokenizer, "--out", tmp_path / "imported"],
             INTERRUPTED, signal.SIGINT)
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_eval_ends_in_one_line_and_writes_no_report(run, tmp_path, capsys, monkeypatch):
    assert unmask_in_process(["export", str(run)]) == 0
    text = tmp_path / "own.txt"
    text.write_text("\n\n".join(f"the {w} sat on the mat, and the {w} ran." for w in WORDS * 4))
    _raise_after(monkeypatch, zero_shot, "load_export", signal.SIGINT)  # the scoring would start next
    _stopped(capsys, ["eval", run, "--datasets", text, "--num-samples", "0"], INTERRUPTED, signal.SIGINT)
    assert not (run / "report").exists() and _hidden(run) == []


def test_an_interrupted_prep_keeps_its_finished_units_and_resumes(tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"the {w} sat on mat {i}" for i, w in enumerate(WORDS * 30)))
    train_sentencepiece([corpus.read_text()], tmp_path / "tok", vocab_size=300)
    argv = ["prep", "--input", corpus, "--out", tmp_path / "data", "--seq-len", "16", "--tokenizer", tmp_path / "tok",
            "--unit-bytes", "1000", "--no-progress", "--json"]
    _raise_after(monkeypatch, UnitTokenizer, "tokenize", signal.SIGINT)  # once the first unit is finished
    _stopped(capsys, argv, INTERRUPTED, signal.SIGINT)
    monkeypatch.undo()
    assert unmask_in_process([str(a) for a in argv]) == 0
    assert '"units_resumed": 1' in capsys.readouterr().out
