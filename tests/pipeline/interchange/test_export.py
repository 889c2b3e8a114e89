"""Export (``pipeline.interchange.export``): the EMA or live weights of a checkpoint, ZeRO-3's
partitions gathered; `unmask export` refuses what is not a run and never clears a directory of
other files. A damaged export (an interrupted copy, a download of something else, a newer or
older format) is refused in one line naming the file and the fix, by every command that reads
one: `unmask sample`, `eval`, `lm-eval` and `export --format hf`. Exports record the size and
sha256 of their files (in their marker), checked at load."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from common.outputs import MARKER
from data_prep.tokenizer.load import load_tokenizer
from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from pipeline.interchange.export import export, load_export
from pipeline.run_dir.layout import RunLayout
from tests.support.cli_refusals import cli_error as _cli
from tests.support.cli_refusals import write_a_file
from tests.support.cli_runner import unmask_in_process
from tests.support.export_fixtures import write_untrained_export
from tests.support.paths import SHARED, needs_shared
from tests.support.train_helpers import run_train, write_config

WORDS = ["cat", "dog", "fox", "owl", "sat", "ran", "mat", "log"]


@pytest.fixture
def a_file(tmp_path) -> Path:
    return write_a_file(tmp_path)


# ------------------------------------------------------------------ the weights of a checkpoint
@pytest.mark.slow
def test_export_gathers_zero3_partitions_into_the_model_weights(tmp_path, shards):
    """With EMA decay 0 the EMA is the live weights: our export of the ZeRO-3 partitions must
    equal DeepSpeed's own consolidation of the same checkpoint, and give the same logits."""

    config = write_config(tmp_path / "c.yaml", {"train": {"zero_stage": 3, "ema_decay": 0.0, "max_steps": 3}})
    run_dir = tmp_path / "run"
    run_train(run_dir, shards, config, world_size=2)
    ema = load_export(export(run_dir, out_dir=tmp_path / "ema"))
    model = load_export(export(run_dir, weights="model", out_dir=tmp_path / "model"))
    ema_weights, model_weights = ema.network.state_dict(), model.network.state_dict()
    assert ema_weights.keys() == model_weights.keys()
    for name in ema_weights:
        assert torch.equal(ema_weights[name], model_weights[name]), name
    z = torch.randint(0, ema.network.config.vocab_size + 1, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ema.network(z), model.network(z))
    assert ema.config["step"] == 3 and ema.tokenizer.sha256 == ema.config["tokenizer_sha256"]


@pytest.mark.slow
def test_ema_export_differs_from_the_live_weights(reference_runs, tmp_path):
    run_dir = reference_runs[2, 3].run_dir
    ema = load_export(export(run_dir, out_dir=tmp_path / "ema")).network.state_dict()
    live = load_export(export(run_dir, weights="model", out_dir=tmp_path / "model")).network.state_dict()
    gap = max((ema[k] - live[k]).abs().max().item() for k in ema)
    assert gap > 1e-4  # decay 0.9 over 6 steps lags the weights


def test_export_refuses_a_missing_run_and_never_clears_a_directory_of_other_files(capsys, a_file, tmp_path):
    assert "does not exist, not a training run directory" in _cli(capsys, "export", str(tmp_path / "nope"))
    assert "is a file, not a training run directory" in _cli(capsys, "export", str(a_file))
    run = tmp_path / "run"
    run.mkdir()
    assert f"--out {a_file}: is a file" in _cli(capsys, "export", str(run), "--out", str(a_file))
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    assert "is not an unmask export: it holds notes.txt" in _cli(capsys, "export", str(run), "--out", str(keep))
    assert (keep / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------ damaged exports
@pytest.fixture(scope="module")
def sound(tmp_path_factory) -> Path:
    """An export as `unmask export` writes it, inside a run directory; tests damage copies."""
    root = tmp_path_factory.mktemp("sound")
    tokenizer = train_sentencepiece([f"the {w} sat on mat {i}" for i, w in enumerate(WORDS * 30)], root / "tok",
                                    vocab_size=300)
    (root / "run" / "checkpoints").mkdir(parents=True)
    return write_untrained_export(RunLayout(root / "run").export, tokenizer, root / "tok")


def _truncate(export: Path) -> None:
    weights = export / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


def _corrupt_header(export: Path) -> None:
    weights = export / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"\xff" * 32  # inside the JSON header; the size stays
    weights.write_bytes(bytes(data))


def _pickle(export: Path) -> None:
    torch.save({"w": torch.zeros(4)}, export / "model.safetensors")


def _not_json(export: Path) -> None:
    (export / "config.json").write_text('{"network": {"n_layers": 1,')


DAMAGE = {"truncated": (_truncate, "model.safetensors"), "corrupt header": (_corrupt_header, "model.safetensors"),
          "a pickle": (_pickle, "model.safetensors"), "config not JSON": (_not_json, "config.json")}


@pytest.fixture(params=sorted(DAMAGE))
def damaged(request, sound, tmp_path) -> tuple[Path, str]:
    """A damaged copy of the export (in a run directory of its own) and the file damaged."""
    damage, name = DAMAGE[request.param]
    run = tmp_path / "run"
    shutil.copytree(sound.parent, run)
    damage(run / "export")
    return run / "export", name


def _one_line(capsys, argv: list[str]) -> str:
    assert unmask_in_process([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_load_export_names_the_damaged_file_and_the_fix_with_or_without_records(damaged):
    export, name = damaged
    fix = f"move {export} away and export again: `unmask export {export.parent}`"
    with pytest.raises(UserError, match=rf"{export / name}.*; the export is damaged .*: {fix}"):
        load_export(export)
    (export / MARKER).unlink()  # an export copied without its marker: found by reading it
    with pytest.raises(UserError, match=rf"{export / name}: not (a readable safetensors file|JSON) .*{fix}"):
        load_export(export)


def test_the_records_find_a_changed_file_of_the_same_size_and_a_copy_still_loads(sound, tmp_path):
    from pipeline.interchange.export import verify_export

    copy = tmp_path / "copy"
    shutil.copytree(sound, copy, copy_function=shutil.copy)  # new modification times: hashed, and sound
    assert verify_export(copy) is None and load_export(copy).config["step"] == 0
    tokenizer = copy / "tokenizer" / "tokenizer.model"
    data = bytearray(tokenizer.read_bytes())
    data[-1] ^= 0xFF
    tokenizer.write_bytes(bytes(data))
    assert verify_export(copy) == f"{tokenizer} has other bytes than were written (sha256 differs)"


def test_a_newer_format_asks_for_a_newer_unmask(sound, tmp_path):
    export = tmp_path / "export"
    shutil.copytree(sound, export)
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "format_version": 99}))
    (export / MARKER).unlink()  # as a newer unmask recorded it: its own records would match
    with pytest.raises(UserError, match=r"config.json: format_version 99 is newer than this unmask reads \(1\); "
                                        r"upgrade unmask"):
        load_export(export)


def test_a_newer_format_written_over_a_recorded_config_still_asks_for_a_newer_unmask(sound, tmp_path, capsys):
    """The marker's records say config.json changed, but its format is what the user must hear."""
    export = tmp_path / "run" / "export"
    shutil.copytree(sound.parent, export.parent)
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "format_version": 9}))
    for target in (export, export.parent):
        err = _one_line(capsys, ["sample", target, "--num", "1", "--steps", "2", "--seq-len", "8"])
        assert f"{export / 'config.json'}: format_version 9 is newer than this unmask reads (1); upgrade unmask" in err


@pytest.mark.parametrize("block_size,problem", [
    (128, "block_size 128 does not divide network.max_seq_len 32"),
    (7, "block_size 7 does not divide network.max_seq_len 32"),
    (0, r"block_size must be an integer >= 1 \(null: one block, MDLM\), got 0"),
    (-16, "block_size must be an integer >= 1 .*, got -16"),
    ("16", "block_size must be an integer >= 1 .*, got '16'"),
])
def test_a_block_size_edited_by_hand_is_refused_at_load_naming_config_json_and_the_field(sound, tmp_path,
                                                                                        block_size, problem):
    """Checked as `unmask train` and the imports check it; the edit is named, not taken for damage
    of the file (its sha256 no longer matches the marker's record) nor blamed on the weights."""
    export = write_untrained_export(tmp_path / "export", load_tokenizer(sound / "tokenizer"), sound / "tokenizer",
                                    config={"block_size": 8}, max_seq_len=32)
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "block_size": block_size}))
    with pytest.raises(UserError, match=rf"^{export / 'config.json'}: {problem}.*; restore the value it was written "
                                        r"with, or export \(or import\) the model again$"):
        load_export(export)


def test_bit_rot_under_an_unchanged_modification_time_is_found_at_load(sound, tmp_path):
    """4 KB of the weights overwritten in place, the modification time restored: every load hashes
    every file (what `sample`, `eval` and `lm-eval` read), and refuses it naming the file."""
    export = tmp_path / "export"
    shutil.copytree(sound, export)
    weights = export / "model.safetensors"
    before = weights.stat()
    with weights.open("r+b") as file:
        file.seek(before.st_size // 2)
        file.write(b"Q" * 4096)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(UserError, match=rf"^{weights} has other bytes than were written \(sha256 differs\); the "
                                        r"export is damaged"):
        load_export(export)


@pytest.mark.parametrize("marker,problem", [
    ('{"kind": "exp', r"cannot be read as JSON \(.*\): the records of the export's files cannot be read"),
    ("[1, 2]", (r"is not the record of an unmask output \(no kind in it\): the records of the export's files cannot "
                r"be read")),
    (None, (r"marks the directory as an output of kind 'prep', not 'export': the records of the export's files "
            r"cannot be trusted")),
])
def test_a_marker_that_is_not_json_or_names_another_kind_is_refused_naming_it(sound, tmp_path, marker, problem):
    """Without a readable marker of an export, its records of the files cannot be checked: refused,
    not loaded without a word."""
    export = tmp_path / "export"
    shutil.copytree(sound, export)
    text = (export / MARKER).read_text()
    (export / MARKER).write_text(text.replace('"kind": "export"', '"kind": "prep"') if marker is None else marker)
    with pytest.raises(UserError, match=rf"^{export / MARKER} {problem}; the export is damaged"):
        load_export(export)


def test_an_export_of_an_older_format_is_refused_in_one_line_with_the_fix(sound, tmp_path):
    export = tmp_path / "export"
    shutil.copytree(sound, export)
    config = json.loads((export / "config.json").read_text())
    (export / MARKER).unlink()  # as copied without its marker: only reading it checks it
    for older in ({key: value for key, value in config.items() if key != "format_version"},
                  {**config, "format_version": 0}):
        (export / "config.json").write_text(json.dumps(older))
        with pytest.raises(UserError, match=r"config.json: format_version (None|0), written by an earlier "
                                            r"unmask \(this one reads 1\); export it again from its training run "
                                            r"\(`unmask export RUN --out DIR`\)") as caught:
            load_export(export)
        assert "\n" not in str(caught.value)


def test_sample_eval_and_export_hf_refuse_a_damaged_export_in_one_line(damaged, tmp_path, capsys):
    export, name = damaged
    own = tmp_path / "own.txt"
    own.write_text("the cat sat on the mat\n\nthe dog ran\n")
    for argv in (["sample", export, "--num", "1", "--steps", "2", "--seq-len", "8"],
                 ["eval", export, "--datasets", own, "--samples", "2"],
                 ["eval", export.parent, "--datasets", own, "--samples", "2"],  # RUN: the export is not up to date
                 ["export", export, "--format", "hf", "--out", tmp_path / "hf"]):
        err = _one_line(capsys, argv)
        assert f"{export / name}" in err and "the export is damaged" in err, (argv, err)
    assert not (tmp_path / "hf").exists() and not (export.parent / "report").exists()


@pytest.mark.slow
@needs_shared("ptb/ptb.test.txt")
def test_lm_eval_refuses_a_damaged_export_in_one_line(sound, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(sound.parent, run)
    _truncate(run / "export")
    err = _one_line(capsys, ["lm-eval", run / "export", "--tasks", "ptb_word_order", "--data-dir", SHARED,
                             "--limit", "2"])
    assert f"{run / 'export' / 'model.safetensors'} has 1000 bytes" in err and "the export is damaged" in err
