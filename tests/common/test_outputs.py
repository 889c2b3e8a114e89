"""Output paths (``common.outputs``): no command deletes finished work, writes where it reads, or
leaves a trace when it fails. The rule is tested once on its owner, then through every command
that writes a directory, on a real training run."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from common.atomic_files import atomic_write_bytes, is_temporary
from common.disk_full import DiskFull
from common.errors import UserError
from common.outputs import (
    MARKER,
    InputPath,
    OutputKind,
    check_output_dir,
    check_output_file,
    entry_names,
    new_output_dir,
    read_marker,
    write_output_file,
)
from data_prep.shards.format import Manifest
from data_prep.tokenizer.base import Tokenizer
from data_prep.tokenizer.load import load_tokenizer
from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from data_prep.write_shards import PrepConfig, write_shards
from evaluation.report.write import REPORT_KIND
from pipeline.interchange.export import EXPORT_KIND
from pipeline.run_dir.layout import RUN_KIND
from tests.support.cli_refusals import write_a_file
from tests.support.cli_runner import unmask_in_process
from tests.support.full_disk import namespaces_work, run_on_small_disk
from tests.support.mdlm_reference import DiTShape, random_weights, write_hugging_face
from tests.support.shard_fixtures import tree_bytes

THING = OutputKind("thing", "a test thing", whole=True)
OTHER = OutputKind("other", "another thing", whole=True)
WORDS = ["cat", "dog", "fox", "owl", "sat", "ran", "mat", "log"]


def _cli(capsys, *argv: str) -> str:
    """Run ``unmask ARGV`` in this process; it must fail with one line: its message."""
    assert unmask_in_process([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"unmask {argv[0]}: error: " in err, err
    return err


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ---------------------------------------------------------------- the owner
def test_a_whole_output_replaces_only_its_own_kind_and_nothing_beside_it(tmp_path):
    target = tmp_path / "out"
    with new_output_dir(target, THING, "--out") as staging:
        (staging / "first").write_text("1")
    marker = read_marker(target)
    assert (marker["kind"], marker["what"], sorted(marker["files"])) == ("thing", "a test thing", ["first"])
    assert marker["files"]["first"]["bytes"] == 1
    with new_output_dir(target, THING, "--out") as staging:
        (staging / "second").write_text("2")
    assert entry_names(target) == {"second"}
    (target / "mine.txt").write_text("keep")
    with pytest.raises(UserError, match=r"--out .*/out: holds mine.txt beside a test thing, and replacing the "
                                        r"directory would delete them; move them out, or choose another --out"):
        with new_output_dir(target, THING, "--out"):
            pass
    assert (target / "mine.txt").read_text() == "keep"
    with pytest.raises(UserError, match=r"holds a test thing \(its .unmask-output.json says so\), not another thing"):
        check_output_dir(target, OTHER, "--out")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"is not a test thing: it holds notes.txt; choose a new or empty directory"):
        check_output_dir(foreign, THING, "--out")


def test_a_failed_whole_output_leaves_the_old_one_and_no_trace(tmp_path):
    target = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError):
        with new_output_dir(target, THING, "--out") as staging:
            (staging / "half").write_text("x")
            raise RuntimeError("the work failed")
    assert not (tmp_path / "a").exists(), "the parents it created stay behind"
    with new_output_dir(target, THING, "--out") as staging:
        (staging / "v1").write_text("1")
    with pytest.raises(RuntimeError):
        with new_output_dir(target, THING, "--out") as staging:
            (staging / "v2").write_text("2")
            raise RuntimeError("the work failed")
    assert entry_names(target) == {"v1"} and [p.name for p in target.parent.iterdir()] == ["out"]
    # A replacement killed between its two renames left the old directory aside: it comes back.
    os.rename(target, target.with_name(f".out.unmask-old-{_dead_pid()}"))
    with pytest.raises(RuntimeError):
        with new_output_dir(target, THING, "--out"):
            raise RuntimeError("the work failed")
    assert entry_names(target) == {"v1"} and [p.name for p in target.parent.iterdir()] == ["out"]


def test_outputs_keep_clear_of_what_they_read(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("text\n")
    reads = [InputPath(corpus, "--input")]
    for out, relation in [(corpus, "is --input"), (tmp_path, "contains --input"), (corpus / "shards", "lies inside --input")]:
        with pytest.raises(UserError, match=rf"--out {out}: {relation} \({corpus}\), which the command reads"):
            check_output_dir(out, THING, "--out", reads)
    run = tmp_path / "run"
    check_output_dir(run, RUN_KIND, "--run-dir", [InputPath(run / "data", "--data", may_lie_inside=True)])


def test_outputs_without_their_marker_are_refused_unless_another_writer_came_first(tmp_path):
    """Only a writer that comes before the marker makes an unmarked directory one of ours (a
    report's MLflow record, written when its tracking starts); the files of an output alone,
    written by an earlier unmask, or copied without the marker, are refused in one line with the fix."""
    report = tmp_path / "report"
    report.mkdir()
    (report / "mlflow_run.json").write_text("{}")
    with pytest.raises(UserError, match="is not a report"):  # a file named mlflow_run.json is not enough
        check_output_dir(report, REPORT_KIND, "--out")
    (report / "mlflow_run.json").write_text(json.dumps({"tracking_uri": "sqlite:///m.db", "run_id": "r"}))
    check_output_dir(report, REPORT_KIND, "--out")  # what tracking writes first: the report's own
    (report / "plots").mkdir()
    for name in ("results.json", "report.md", "report.html"):
        (report / name).write_text(json.dumps({"model": {}, "datasets": {}}))
    with pytest.raises(UserError, match=r"is not a report of `unmask eval`: it holds mlflow_run.json, plots/, "
                                        r"report.html and 2 more; choose a new or empty directory for --out") as caught:
        check_output_dir(report, REPORT_KIND, "--out")  # a report's files without the marker
    assert "\n" not in str(caught.value)
    export = tmp_path / "export"
    (export / "tokenizer").mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"")
    (export / "config.json").write_text(json.dumps({"format_version": 1, "network": {}}))
    with pytest.raises(UserError, match=r"holds an unmask export without its .unmask-output.json \(written by an "
                                        r"earlier unmask, or copied without that file\), which is not replaced; move "
                                        r"it away, or choose a new or empty directory for --out"):
        check_output_dir(export, EXPORT_KIND, "--out")
    (export / MARKER).write_text(json.dumps({"kind": "export", "what": "an unmask export"}))  # records no files
    with pytest.raises(UserError, match=r"holds an unmask export written by an earlier unmask \(its .unmask-output.json "
                                        r"records no files\), which this unmask does not replace; move it away"):
        check_output_dir(export, EXPORT_KIND, "--out")


# ---------------------------------------------------------------- through the commands
@pytest.fixture
def run(micro_run, tmp_path) -> Path:
    """A finished training run of its own (conftest's micro_run)."""
    copy = tmp_path / "run"
    shutil.copytree(micro_run, copy)
    return copy


@pytest.mark.slow
def test_export_never_writes_over_the_run_or_a_directory_of_other_files(run, tmp_path, capsys):
    finished = tree_bytes(run)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "config.json").write_text("{}")
    (mixed / "notes.txt").write_text("mine")
    for fmt, kind in (("unmask", "an unmask export"), ("hf", "a transformers directory")):
        err = _cli(capsys, "export", run, "--out", run, "--format", fmt)
        assert f"--out {run}: contains the checkpoints it exports" in err
        err = _cli(capsys, "export", run, "--out", mixed, "--format", fmt)
        assert f"--out {mixed}: is not {kind}" in err and "it holds config.json, notes.txt;" in err
    assert tree_bytes(run) == finished and (mixed / "notes.txt").read_text() == "mine"
    assert unmask_in_process(["export", str(run)]) == 0
    assert unmask_in_process(["export", str(run)]) == 0
    assert read_marker(run / "export")["kind"] == "export"  # an export replaces an export
    marker = (run / "export" / MARKER).read_bytes()
    (run / "export" / MARKER).unlink()  # as an export copied without its marker: not replaced
    assert f"--out {run / 'export'}: holds an unmask export without its {MARKER}" in _cli(capsys, "export", run)
    (run / "export" / MARKER).write_bytes(marker)
    run_marker = (run / MARKER).read_bytes()
    (run / MARKER).unlink()  # a run without its marker: its own files do not make it one
    with pytest.raises(UserError, match="is not an unmask training run: it holds checkpoints/, config.json"):
        check_output_dir(run, RUN_KIND, "--run-dir")
    (run / MARKER).write_bytes(run_marker)
    err = _cli(capsys, "export", run / "export", "--format", "hf", "--out", run / "export")
    assert "is the export it converts" in err
    assert "holds an unmask export (its .unmask-output.json says so), not a transformers directory" in _cli(
        capsys, "export", run, "--format", "hf", "--out", run / "export")


@pytest.fixture(scope="module")
def mdlm_model(tmp_path_factory) -> tuple[Path, Path]:
    """A small MDLM Hugging Face directory and its tokenizer."""
    root = tmp_path_factory.mktemp("mdlm")
    lines = [f"the {WORDS[i % 8]} {WORDS[i * 3 % 8]} on mat {i}" for i in range(200)]
    tokenizer = train_sentencepiece(lines, root / "tok", vocab_size=300)
    shape = DiTShape(vocab_size=tokenizer.vocab_size)
    return write_hugging_face(root / "mdlm", random_weights(shape, seed=0), shape), root / "tok"


@pytest.mark.slow
def test_import_never_replaces_its_source_its_tokenizer_or_a_run(mdlm_model, run, capsys):
    source, tokenizer = mdlm_model
    kept = tree_bytes(source)
    assert f"--out {source}: is SOURCE" in _cli(capsys, "import", "mdlm", source, "--tokenizer", tokenizer,
                                                 "--out", source)
    assert f"--out {tokenizer}: is --tokenizer" in _cli(capsys, "import", "mdlm", source, "--tokenizer", tokenizer,
                                                        "--out", tokenizer)
    finished = tree_bytes(run)
    assert "holds an unmask training run" in _cli(capsys, "import", "mdlm", source, "--tokenizer", tokenizer,
                                                  "--out", run)
    assert tree_bytes(source) == kept and tree_bytes(run) == finished


@pytest.mark.slow
def test_prep_refuses_a_run_dir_and_its_own_input_and_train_its_data(run, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n\n".join(f"the {w} sat on the mat" for w in WORDS * 20))
    finished = tree_bytes(run)
    err = _cli(capsys, "prep", "--input", corpus, "--out", run, "--seq-len", "16", "--vocab-size", "300")
    assert f"--out {run}: holds an unmask training run" in err and tree_bytes(run) == finished
    assert f"--out {corpus}: is --input" in _cli(capsys, "prep", "--input", corpus, "--out", corpus, "--seq-len", "16",
                                                 "--vocab-size", "300")
    assert list(corpus.iterdir()) == [corpus / "a.txt"]
    data = json.loads((run / "config.json").read_text())["data"]["path"]
    assert f"--run-dir {data}: is --data" in _cli(capsys, "train", "--data", data, "--run-dir", data)
    inside = Path(data) / "run"
    assert "lies inside --data" in _cli(capsys, "train", "--data", data, "--run-dir", inside)
    assert not inside.exists()


@pytest.mark.slow
def test_a_failed_command_leaves_no_output_directory(run, mdlm_model, tmp_path, capsys):
    source, tokenizer = mdlm_model
    new = tmp_path / "new" / "dir"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    own = tmp_path / "own.txt"
    own.write_text("a paragraph\n")
    failures = [
        ["eval", tmp_path / "no-run", "--datasets", own, "--out", new],
        ["import", "mdlm", tmp_path / "no-model", "--tokenizer", tokenizer, "--out", new],
        ["prep", "--input", empty, "--out", new, "--seq-len", "16", "--tokenizer", run / "tokenizer", "--no-progress"],
        ["prep", "--input", own, "--out", new, "--seq-len", "16", "--tokenizer", tmp_path / "no-tokenizer"],
        ["tokenizer", "train", "--input", empty, "--out", new, "--vocab-size", "300"],
    ]
    for argv in failures:
        _cli(capsys, *argv)
        assert not (tmp_path / "new").exists(), argv
    # `unmask run` failing in its prep stage: RUN does not stay behind holding its marker alone.
    assert unmask_in_process(["run", "--input", str(empty), "--run-dir", str(new), "--tokenizer",
                              str(run / "tokenizer")]) == 2
    assert "unmask run: error: stage prep failed" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_eval_checks_the_reference_before_any_work(run, tmp_path, capsys):
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "weights.bin").write_bytes(b"\0" * 64)
    own = tmp_path / "own.txt"
    own.write_text("a paragraph\n")
    err = _cli(capsys, "eval", run, "--datasets", own, "--num-samples", "1", "--reference", garbage)
    assert f"--reference {garbage}: neither an unmask export" in err
    assert not (run / "export").exists() and not (run / "report").exists(), "work was done before the refusal"
    assert f"--out {run}: contains the export it evaluates" in _cli(capsys, "eval", run, "--datasets", own,
                                                                    "--out", run)


@pytest.mark.slow
def test_sample_replaces_only_a_samples_file(run, capsys):
    metrics = (run / "metrics.jsonl").read_text()
    assert unmask_in_process(["export", str(run)]) == 0
    base = ["sample", str(run), "--num", "1", "--steps", "2", "--seq-len", "8"]
    err = _cli(capsys, *base, "--out", run / "metrics.jsonl")
    assert "exists and is not a samples file of `unmask sample`" in err and (run / "metrics.jsonl").read_text() == metrics
    assert "lies inside the export it samples" in _cli(capsys, *base, "--out", run / "export" / "config.json")
    samples = run / "samples" / "s.jsonl"
    assert unmask_in_process([*base, "--out", str(samples)]) == 0
    assert unmask_in_process([*base, "--out", str(samples), "--seed", "1"]) == 0  # its own kind: replaced


def _small_prep(root: Path) -> tuple[PrepConfig, Tokenizer, Path]:
    """A finished prep of a small corpus into ROOT/data: its config, tokenizer and directory."""
    corpus = root / "c.txt"
    corpus.write_text("\n\n".join(f"the {w} sat on mat {i}" for i, w in enumerate(WORDS * 30)))
    tokenizer = train_sentencepiece([corpus.read_text()], root / "tok", vocab_size=300)
    config = PrepConfig(inputs=(str(corpus),), seq_len=16, val_fraction=0.1)
    write_shards(config, tokenizer, root / "data", progress=False)
    return config, tokenizer, root / "data"


def test_a_prep_clears_what_killed_shard_writers_left(tmp_path):
    config, tokenizer, out = _small_prep(tmp_path)
    shard = out / Manifest.read(out).splits["train"].shards[0].path
    left = shard.with_name(f".{shard.name}.tmp-{_dead_pid()}")  # what a writer killed before its rename leaves
    assert is_temporary(left.name)
    left.write_bytes(shard.read_bytes()[:100])
    (out / "manifest.json").unlink()  # the prep did not finish
    write_shards(config, tokenizer, out, progress=False)
    assert not left.exists()
    assert sorted(p.name for p in shard.parent.iterdir()) == sorted(
        Path(s.path).name for s in Manifest.read(out).splits["train"].shards)


def test_a_prep_without_its_marker_is_refused_and_a_rerun_puts_back_a_removed_tokenizer(tmp_path):
    """The files of a prep without its marker (written by an earlier unmask, or copied without it) are not
    taken for a prep; a finished prep whose tokenizer/ was removed gets it back from a rerun,
    which has nothing else to do."""
    config, tokenizer, out = _small_prep(tmp_path)
    marker = (out / MARKER).read_bytes()
    (out / MARKER).unlink()
    finished = tree_bytes(out)
    with pytest.raises(UserError, match=rf"--out {out}: is not the shards of `unmask prep`: it holds manifest.json, "
                                        r"tokenizer/, train/ and 1 more; choose a new or empty directory for --out"):
        write_shards(config, tokenizer, out, progress=False)
    assert tree_bytes(out) == finished
    (out / MARKER).write_bytes(marker)
    shutil.rmtree(out / "tokenizer")
    again = write_shards(config, tokenizer, out, progress=False)
    assert again.nothing_to_do and read_marker(out)["kind"] == "prep"
    assert load_tokenizer(out / "tokenizer").sha256 == tokenizer.sha256


# ---------------------------------------------------------------- at every depth, and more than a name
@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory) -> tuple[Tokenizer, Path]:
    root = tmp_path_factory.mktemp("tok")
    tokenizer = train_sentencepiece([f"the {w} sat on mat {i}" for i, w in enumerate(WORDS * 30)], root / "tok",
                                    vocab_size=300)
    saved = root / "saved"
    tokenizer.save(saved)
    return tokenizer, saved


def test_a_report_is_replaced_only_while_it_holds_nothing_but_what_was_written_at_any_depth(tmp_path):
    from evaluation.report.write import write_report
    from tests.support.results_fixtures import make_results

    report = tmp_path / "report"
    write_report(make_results(), report)
    assert "plots/per_t_lambada.png" in read_marker(report)["files"]
    figure = report / "plots" / "my_figure.png"
    figure.write_bytes(b"the user's figure")
    with pytest.raises(UserError, match=r"holds plots/my_figure.png beside a report of `unmask eval`, and replacing "
                                        r"the directory would delete them"):
        write_report(make_results(), report)
    assert figure.read_bytes() == b"the user's figure"
    # The same report marked as an earlier unmask did (top-level names only): refused, its own files or not.
    marker = read_marker(report)
    written = (report / MARKER).read_bytes()
    (report / MARKER).write_text(json.dumps({"kind": "report", "what": marker["what"], "entries": sorted(
        entry_names(report))}))
    with pytest.raises(UserError, match="holds a report of `unmask eval` written by an earlier unmask"):
        write_report(make_results(), report)
    figure.unlink()
    with pytest.raises(UserError, match=r"records no files\), which this unmask does not replace; move it away"):
        write_report(make_results(), report)
    (report / MARKER).write_bytes(written)
    write_report(make_results(), report)  # its own files only: replaced, and marked with them
    edited = report / "report.md"
    edited.write_text(edited.read_text() + "\nmy notes\n")
    with pytest.raises(UserError, match=r"report.md has \d+ bytes, \d+ were written .* since a report of `unmask "
                                        r"eval` was written, and replacing the directory would delete it"):
        write_report(make_results(), report)
    assert edited.read_text().endswith("my notes\n")


def test_what_other_steps_add_to_a_report_is_carried_into_its_replacement(tmp_path):
    from evaluation.report.write import write_report
    from tests.support.results_fixtures import make_results

    report = tmp_path / "report"
    write_report(make_results(), report)
    (report / "mlflow_run.json").write_text('{"run_id": "r"}')  # tracking records the report's run after it
    write_report(make_results(), report)
    assert (report / "mlflow_run.json").read_text() == '{"run_id": "r"}'


def test_an_export_keeps_a_file_the_user_put_in_its_tokenizer(tmp_path, small_tokenizer):
    from tests.support.export_fixtures import write_untrained_export

    tokenizer, saved = small_tokenizer
    export = write_untrained_export(tmp_path / "export", tokenizer, saved)
    notes = export / "tokenizer" / "NOTES.txt"
    notes.write_text("where this tokenizer came from")
    with pytest.raises(UserError, match=r"holds tokenizer/NOTES.txt beside an unmask export"):
        write_untrained_export(export, tokenizer, saved)
    assert notes.read_text() == "where this tokenizer came from"
    marker = (export / MARKER).read_bytes()
    (export / MARKER).unlink()  # as an export copied without its marker: not replaced, with the note or without
    with pytest.raises(UserError, match=r"holds an unmask export without its .unmask-output.json \(written by an "
                                        r"earlier unmask, or copied without that file\), which is not replaced; "
                                        r"beside it, tokenizer/NOTES.txt, which is not part of one; move it away"):
        write_untrained_export(export, tokenizer, saved)
    notes.unlink()
    with pytest.raises(UserError, match=r"holds an unmask export without its .unmask-output.json \([^)]*\), which "
                                        r"is not replaced; move it away"):
        write_untrained_export(export, tokenizer, saved)
    for garbled, named in ((b'{"kind": "exp', f"{export / MARKER} cannot be read as JSON"),
                           (b"[1, 2]", f"{export / MARKER} is not the record of an unmask output")):
        (export / MARKER).write_bytes(garbled)  # the refusal names the marker, not the files it would have described
        with pytest.raises(UserError, match=re.escape(named) + r".*so the directory is not known to hold an unmask "
                                                               r"export; move it away"):
            write_untrained_export(export, tokenizer, saved)
    (export / MARKER).write_bytes(marker.replace(b'"kind": "export"', b'"kind": "prep"'))  # its kind changed by hand
    with pytest.raises(UserError, match=r"holds an output of kind 'prep' \(its .unmask-output.json says so\), not an "
                                        r"unmask export"):
        write_untrained_export(export, tokenizer, saved)
    (export / MARKER).write_bytes(marker)
    write_untrained_export(export, tokenizer, saved)
    assert read_marker(export)["kind"] == "export"


def test_a_directory_of_the_users_own_files_is_not_taken_for_a_run(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    config = {"model": {"preset": "tiny"}, "train": {"max_steps": 5}, "data": {"path": "x"}}
    cases = {"metrics": {"notes.txt": "mine", "metrics.jsonl": '{"step": 1, "loss": 2.0}\n'},
             "config": {"notes.txt": "mine", "config.json": json.dumps(config)},
             "config-alone": {"config.json": json.dumps(config)},
             "metrics-alone": {"metrics.jsonl": '{"step": 1, "loss": 2.0}\n'}}
    for name, files in cases.items():
        directory = tmp_path / name
        directory.mkdir()
        for file, text in files.items():
            (directory / file).write_text(text)
        err = _cli(capsys, "train", "--data", data, "--run-dir", directory)
        assert f"--run-dir {directory}: is not an unmask training run: it holds" in err, name
        assert {p.name: p.read_text() for p in directory.iterdir()} == files, name
    # Two things only a run holds (its resolved config and its tokenizer) do not make a run without its marker.
    (tmp_path / "config-alone" / "tokenizer").mkdir()
    with pytest.raises(UserError, match="is not an unmask training run: it holds config.json, tokenizer/"):
        check_output_dir(tmp_path / "config-alone", RUN_KIND, "--run-dir")
    # A folder named data/ or corpus/ is not `unmask run`'s before its first step unless it holds what that writes.
    own = tmp_path / "own"
    (own / "corpus").mkdir(parents=True)
    (own / "corpus" / "my-book.txt").write_text("mine")
    with pytest.raises(UserError, match="is not an unmask training run: it holds corpus/"):
        check_output_dir(own, RUN_KIND, "--run-dir")
    (own / "corpus" / "my-book.txt").rename(own / "corpus" / "cpython-3.11.7-docs.jsonl")
    check_output_dir(own, RUN_KIND, "--run-dir")
    # What the Ray Train launcher writes before training marks the directory: its records, and the
    # checkpoint it restores from --storage (a step-N with its state, and checkpoints/latest naming it).
    restored = tmp_path / "restored"
    (restored / "ray_train").mkdir(parents=True)
    check_output_dir(restored, RUN_KIND, "--run-dir")
    step = restored / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    (step / "unmask_state.json").write_text("{}")
    with pytest.raises(UserError, match="is not an unmask training run: it holds checkpoints/, ray_train/"):
        check_output_dir(restored, RUN_KIND, "--run-dir")  # without latest: not what the launcher leaves
    (restored / "checkpoints" / "latest").write_text("step-00000004")
    check_output_dir(restored, RUN_KIND, "--run-dir")


@pytest.fixture
def a_file(tmp_path) -> Path:
    return write_a_file(tmp_path)


def test_output_paths_that_are_files_or_below_files_are_refused(a_file):
    from common.outputs import check_output_dir, check_output_file
    from pipeline.interchange.export import EXPORT_KIND

    with pytest.raises(UserError, match=r"--out .*a-file: is a file, not a directory"):
        check_output_dir(a_file, EXPORT_KIND, "--out")
    with pytest.raises(UserError, match=r"--out .*a-file/sub: lies below .*a-file, which is a file"):
        check_output_dir(a_file / "sub", EXPORT_KIND, "--out")
    with pytest.raises(UserError, match=r"--out .*: is a directory; give a file name"):
        check_output_file(a_file.parent, "--out")


def test_an_unwritable_output_directory_is_named(tmp_path, monkeypatch):
    from common.outputs import check_output_dir
    from pipeline.run_dir.layout import RUN_KIND

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)
    with pytest.raises(UserError, match=r"--run-dir .*: cannot write there \(Permission denied\); choose a "
                                        r"directory you can write to"):
        check_output_dir(tmp_path / "run", RUN_KIND, "--run-dir")


# ---------------------------------------------------------------- what is not a file, links, a full disk
def test_a_device_or_fifo_is_written_in_place_and_a_socket_or_a_link_refused(tmp_path):
    """Never replaced (an atomic write renames over its target: as root, /dev/null became a file)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert check_output_file(fifo, "--out") == fifo
        write_output_file(fifo, b"through the pipe\n")
        assert os.read(reader, 100) == b"through the pipe\n"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with pytest.raises(UserError, match=r"is a FIFO \(named pipe\), not a file; unmask replaces the files it writes"):
        atomic_write_bytes(fifo, b"x")  # what every other write goes through refuses it too
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "socket"))
        with pytest.raises(UserError, match=r"--out .*socket: is a socket, not a file; give a file name"):
            check_output_file(tmp_path / "socket", "--out")
    (tmp_path / "mine.txt").write_text("mine")
    for name, target in (("link", tmp_path / "mine.txt"), ("dangling", tmp_path / "nowhere")):
        (tmp_path / name).symlink_to(target)
        with pytest.raises(UserError, match=rf"--out .*{name}: is a symbolic link \(to {target}\); unmask replaces "
                                            r"the file it writes, which would replace the link"):
            check_output_file(tmp_path / name, "--out")
    assert (tmp_path / "mine.txt").read_text() == "mine"


def test_a_full_device_is_one_line(tmp_path):
    """/dev/full answers every write with ENOSPC, as a full disk does."""
    full = tmp_path / "full"
    full.symlink_to("/dev/full")
    with pytest.raises(DiskFull, match=rf"^{full}: no space left on device while writing it; it is as it was: free "
                                       r"space on that disk \(or write elsewhere\) and rerun the same command$"):
        write_output_file(check_output_file(full, "--out"), b"x" * 100)


def test_a_write_check_a_killed_process_left_is_cleared(tmp_path):
    left = tmp_path / f".unmask-write-check-{_dead_pid()}-abc123"
    left.write_bytes(b"")
    check_output_dir(tmp_path / "export", EXPORT_KIND, "--out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(not namespaces_work(), reason="unprivileged user and mount namespaces are not available")
def test_a_full_disk_during_export_is_one_line_and_leaves_nothing(micro_run, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    done = run_on_small_disk(["export", str(micro_run), "--out", str(disk / "export")], disk, "64k", fill=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        f"unmask export: error: --out {disk / 'export'}: no space left on device while writing an unmask export; "
        f"nothing of it was kept ({disk / 'export'} was not created), and what the command read is untouched: free "
        "space on that disk (or give another --out) and rerun the same command")
    assert done.listing == ["filler"], "no staging directory is left"
