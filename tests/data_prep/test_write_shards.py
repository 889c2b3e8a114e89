"""The shard writer (``data_prep.write_shards``) end to end on real text, in one process (one
worker) and with a real local Ray (more): exact accounting, determinism across worker counts and
the two ways of running, idempotence, resume after SIGKILL and after a changed error policy
(``data_prep.resume``), bad input."""

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from common.errors import UserError
from data_prep.readers import ReadCounters, ReadOptions, plan_units, read_unit, resolve_inputs
from data_prep.resume import WORK_DIR
from data_prep.shards.format import Manifest, iter_chunks
from data_prep.tokenizer.load import load_tokenizer
from data_prep.write_shards import PrepConfig, write_shards
from tests.support.cli_runner import cli_env, run_unmask
from tests.support.paths import GPT2, PTB, REPO, TINY, needs_shared
from tests.support.shard_fixtures import tree_bytes

SMALL = dict(seq_len=128, val_fraction=0.05, shard_bytes=64 << 10, unit_bytes=64 << 10)
POLL_SECONDS = 0.05
KILL_DEADLINE_SECONDS = 300

pytestmark = needs_shared(TINY, PTB, GPT2)


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=3, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_local_ray_is_pinned_to_loopback(ray_local):
    import ray

    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer(GPT2)


@pytest.fixture(scope="module")
def reference(ray_local, gpt2, tmp_path_factory):
    """An uninterrupted prep of tinyshakespeare + PTB test with one worker."""
    out = tmp_path_factory.mktemp("reference")
    config = PrepConfig(inputs=(str(TINY), str(PTB)), **SMALL)
    return config, write_shards(config, gpt2, out, workers=1, progress=False), out


def _documents(config: PrepConfig) -> list[str]:
    """The documents, read independently of the prep pipeline, in corpus order."""
    counters = ReadCounters()
    return [p.text for unit in plan_units(resolve_inputs(config.inputs), config.read)
            for p in read_unit(unit, config.read, counters)]


def _split_tokens(out: Path, split: str) -> np.ndarray:
    manifest = Manifest.read(out)
    chunks = []
    for shard in manifest.splits[split].shards:
        with open(out / shard.path, "rb") as stream:
            chunks.extend(iter_chunks(stream))
    tokens = np.concatenate(chunks).reshape(-1) if chunks else np.empty(0, np.uint16)
    padding = manifest.splits[split].padding_tokens
    assert bool((tokens[len(tokens) - padding:] == manifest.pad_id).all())
    return tokens[:len(tokens) - padding]


def test_shards_hold_exactly_the_documents_with_eos(reference, gpt2):
    config, result, out = reference
    manifest = result.manifest
    documents = _documents(config)
    decoded = {}
    for split in ("train", "val"):
        tokens = _split_tokens(out, split)
        info = manifest.splits[split]
        assert len(tokens) == info.tokens and tokens[-1] == gpt2.eos_id
        ends = np.flatnonzero(tokens == gpt2.eos_id)
        starts = np.concatenate([[0], ends[:-1] + 1])
        decoded[split] = [gpt2.decode(tokens[a:b].tolist()) for a, b in zip(starts, ends)]
        assert len(decoded[split]) == info.documents
        assert info.utf8_bytes == sum(len(d.encode()) for d in decoded[split])
        assert info.utf8_bytes == sum(shard.utf8_bytes for shard in info.shards)
        assert info.sequences * config.seq_len == info.tokens + info.padding_tokens
    # Exact accounting: tokens == sum over documents of (tokens + 1 EOS).
    assert sum(s.tokens for s in manifest.splits.values()) == sum(len(gpt2.encode(d)) + 1 for d in documents)
    # Each document sits in exactly one split, in corpus order there.
    train, val = decoded["train"], decoded["val"]
    assert sorted(train + val) == sorted(documents)
    assert not set(train) & set(val)
    # Corpus order within each split (duplicates of a text share its split).
    train_texts, val_texts = set(train), set(val)
    assert train == [d for d in documents if d in train_texts]
    assert val == [d for d in documents if d in val_texts]
    assert 0.02 < len(val) / len(documents) < 0.08  # val_fraction 0.05
    assert manifest.counts["documents"] == len(documents)
    assert manifest.tokenizer["sha256"] == gpt2.sha256 and manifest.dtype == "<u2"


def test_same_output_with_one_or_two_workers_and_rerun_does_nothing(reference, gpt2, tmp_path):
    config, _, out = reference  # one worker: in this process, without Ray
    two = write_shards(config, gpt2, tmp_path, workers=2, progress=False)  # two Ray actors
    assert tree_bytes(tmp_path) == tree_bytes(out)
    assert not (tmp_path / WORK_DIR).exists()
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    again = write_shards(config, gpt2, tmp_path, workers=2, progress=False)
    assert again.nothing_to_do and not two.nothing_to_do
    assert "nothing to do" in again.summary()
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == stamps


def test_a_one_worker_prep_runs_without_ray(tmp_path):
    """Ray's start-up would be most of a small prep's time, and one worker gains nothing from it."""
    script = ("import sys; from data_prep.write_shards import PrepConfig, write_shards; from data_prep.tokenizer.load "
              f"import load_tokenizer; write_shards(PrepConfig(inputs=({str(PTB)!r},), seq_len=64), "
              f"load_tokenizer({str(GPT2)!r}), {str(tmp_path)!r}, progress=False); assert 'ray' not in sys.modules, "
              f"'Ray was imported'")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Manifest.read(tmp_path).counts["documents"] > 0


def _cli_args(out: Path) -> list[str]:
    return ["prep", "--input", str(TINY), str(PTB), "--out", str(out), "--tokenizer", str(GPT2),
            "--seq-len", str(SMALL["seq_len"]), "--val-fraction", str(SMALL["val_fraction"]),
            "--shard-bytes", str(SMALL["shard_bytes"]), "--unit-bytes", str(SMALL["unit_bytes"]),
            "--workers", "1", "--no-progress", "--json"]


def _kill_when_ledger_reaches(out: Path, entries: int) -> None:
    command = [sys.executable, "-m", "tests.support.prep_stall", str(entries), "--", *_cli_args(out)]
    process = subprocess.Popen(command, cwd=REPO, env=cli_env(), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ledger = out / WORK_DIR / "ledger"
    deadline = time.monotonic() + KILL_DEADLINE_SECONDS
    while not (ledger.is_dir() and len(list(ledger.glob("*.json"))) >= entries):
        assert process.poll() is None, "prep ended before reaching the kill point"
        assert time.monotonic() < deadline, "prep did not reach the kill point"
        time.sleep(POLL_SECONDS)  # waiting for a condition, not timing anything
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["tokenize", "shards"])
def test_sigkilled_prep_resumes_to_identical_output_without_redoing_work(reference, tmp_path, stage):
    config, _, out = reference
    units = len(plan_units(resolve_inputs(config.inputs), config.read, config.unit_bytes))
    kill_at = 3 if stage == "tokenize" else units + 2
    killed = tmp_path / "killed"
    _kill_when_ledger_reaches(killed, kill_at)
    assert not (killed / "manifest.json").exists()
    finished_shards = {p: p.stat().st_mtime_ns for p in killed.glob("*/shard-*.tar")}
    rerun = run_unmask(_cli_args(killed), installed=True, timeout=KILL_DEADLINE_SECONDS)
    assert rerun.returncode == 0, rerun.stderr
    figures = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert figures["units_resumed"] >= min(kill_at, units) and figures["units_run"] == units - figures["units_resumed"]
    if stage == "shards":
        assert figures["shards_resumed"] >= 2 and len(finished_shards) >= 2
    assert {p: p.stat().st_mtime_ns for p in finished_shards} == finished_shards, "finished shards were rewritten"
    assert tree_bytes(killed) == tree_bytes(out)


def test_a_different_prep_in_the_output_is_refused_unless_overwrite(reference, gpt2, tmp_path):
    config, _, out = reference
    target = tmp_path / "out"
    shutil.copytree(out, target)
    other = PrepConfig(inputs=config.inputs, **{**SMALL, "seq_len": 64})
    with pytest.raises(UserError, match="holds a different prep's manifest; pass --overwrite"):
        write_shards(other, gpt2, target, progress=False)
    assert tree_bytes(target) == tree_bytes(out), "a refusal must not touch the output"
    result = write_shards(other, gpt2, target, overwrite=True, progress=False)
    assert result.manifest.seq_len == 64 and not (target / "train" / "shard-000100.tar").exists()


def test_bad_input_is_reported_by_file_and_line_through_ray(ray_local, gpt2, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": "also fine"}\nnot json\n')
    config = PrepConfig(inputs=(str(corpus),), seq_len=16)
    for workers in (1, 2):  # in this process, and through Ray's actors
        with pytest.raises(UserError, match=r"corpus.jsonl:3"):
            write_shards(config, gpt2, tmp_path / f"out-{workers}", workers=workers, progress=False)
    skipping = PrepConfig(inputs=(str(corpus),), seq_len=16, read=ReadOptions(bad_json="skip"))
    manifest = write_shards(skipping, gpt2, tmp_path / "out2", progress=False).manifest
    assert manifest.counts["bad_json_skipped"] == 1 and manifest.counts["documents"] == 2
    with pytest.raises(UserError, match="missing.txt"):
        write_shards(PrepConfig(inputs=(str(tmp_path / "missing.txt"),), seq_len=16), gpt2, tmp_path / "o3",
                     progress=False)


def test_repaired_skipped_and_empty_documents_are_counted(ray_local, gpt2, tmp_path):
    raw = b"good one\n   \nbad \xff byte\nlast\n"  # lines: the second is whitespace only
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(raw))
    for mode, kept, counter in (("replace", 3, "bad_utf8_repaired"), ("skip", 2, "bad_utf8_skipped")):
        config = PrepConfig(inputs=(str(tmp_path / "a.txt.gz"),), seq_len=8, val_fraction=0.0,
                            read=ReadOptions(text_format="lines", bad_utf8=mode))
        manifest = write_shards(config, gpt2, tmp_path / mode, progress=False).manifest
        assert manifest.counts["documents"] == kept and manifest.counts[counter] == 1
        assert manifest.counts["empty_skipped"] == 1 and manifest.splits["val"].documents == 0


def test_binary_inputs_are_skipped_counted_and_named(ray_local, gpt2, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("first paragraph\n\nsecond one\n")
    (corpus / "logo").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" * 10)
    (corpus / "notes.txt").write_bytes("UTF-16 notes\n".encode("utf-16"))
    result = write_shards(PrepConfig(inputs=(str(corpus),), seq_len=8, val_fraction=0.0), gpt2, tmp_path / "out",
                          progress=False)
    manifest = result.manifest
    assert manifest.counts["binary_files_skipped"] == 2 and manifest.counts["documents"] == 2
    skipped = {Path(entry["uri"]).name: entry.get("skipped") for entry in manifest.inputs}
    assert skipped["a.txt"] is None and "NUL bytes" in skipped["logo"] and "UTF-16" in skipped["notes.txt"]
    warning = "\n".join(result.warnings())
    assert "skipped 2 input file(s) as binary" in warning and "iconv -f UTF-16 -t UTF-8" in warning
    assert str(corpus / "logo") in warning and str(corpus / "notes.txt") in warning


def _policy_corpus(root: Path) -> tuple[str, ...]:
    """Three JSONL files in several units each: invalid UTF-8 in a text field of the first, a
    line that is not JSON at the very end of the last (the last unit, so the others finish)."""
    lines = [json.dumps({"text": f"document number {i}: " + "word " * (i % 7)}) for i in range(60)]
    (root / "a.jsonl").write_bytes("\n".join(lines[:20]).encode() + b'\n{"text": "caf\xe9 au lait"}\n')
    (root / "b.jsonl").write_text("\n".join(lines[20:40]) + "\n")
    (root / "c.jsonl").write_text("\n".join(lines[40:]) + "\nnot json\n")
    return tuple(str(root / name) for name in ("a.jsonl", "b.jsonl", "c.jsonl"))


def test_a_changed_error_policy_resumes_a_failed_prep_to_the_uninterrupted_output(ray_local, gpt2, tmp_path):
    inputs = _policy_corpus(tmp_path)
    small = dict(inputs=inputs, seq_len=16, val_fraction=0.2, unit_bytes=400)
    units = plan_units(resolve_inputs(inputs), ReadOptions(), 400)
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"c.jsonl:21: not valid JSON.*--bad-json skip"):
        write_shards(PrepConfig(**small), gpt2, out, progress=False)
    assert len(list((out / WORK_DIR / "ledger").glob("unit-*.json"))) == len(units) - 1
    final = ReadOptions(bad_json="skip", bad_utf8="skip")
    resumed = write_shards(PrepConfig(**small, read=final), gpt2, out, progress=False)  # no --overwrite needed
    # Only the unit with the invalid UTF-8 (--bad-utf8 changed) and the failed one are redone.
    assert (resumed.units_resumed, resumed.units_run) == (len(units) - 2, 2)
    assert "--bad-utf8 replace -> skip" in resumed.summary() and "--bad-json error -> skip" in resumed.summary()
    assert resumed.manifest.counts["bad_utf8_skipped"] == 1 and resumed.manifest.counts["bad_json_skipped"] == 1
    reference = tmp_path / "reference"
    write_shards(PrepConfig(**small, read=final), gpt2, reference, progress=False)
    assert tree_bytes(out) == tree_bytes(reference)
    # Any other change to an unfinished prep is still a different prep.
    (out / "manifest.json").unlink()
    (out / WORK_DIR / "units").mkdir(parents=True)
    (out / WORK_DIR / "identity.json").write_text(json.dumps({"sha256": "another", "config": {"read": {}}}))
    with pytest.raises(UserError, match="unfinished work of a different prep; pass --overwrite"):
        write_shards(PrepConfig(**small, read=final), gpt2, out, progress=False)


def test_a_policy_change_that_retrained_the_tokenizer_redoes_every_unit(ray_local, gpt2, tmp_path):
    """`unmask prep --vocab-size` trains its tokenizer from the inputs and read flags: a changed
    flag may change the tokenizer, and then every unit is redone (still no --overwrite)."""
    from data_prep.tokenizer.sentencepiece_model import train_sentencepiece

    inputs = _policy_corpus(tmp_path)
    small = dict(inputs=inputs, seq_len=16, val_fraction=0.2, unit_bytes=400)
    out = tmp_path / "out"
    with pytest.raises(UserError, match="not valid JSON"):
        write_shards(PrepConfig(**small), gpt2, out, progress=False)
    final = PrepConfig(**small, read=ReadOptions(bad_json="skip"))
    retrained = train_sentencepiece(_documents(final), tmp_path / "tokenizer", 300)
    with pytest.raises(UserError, match="unfinished work of a different prep"):  # a tokenizer given by the user
        write_shards(final, retrained, out, progress=False)
    resumed = write_shards(final, retrained, out, progress=False, tokenizer_follows_inputs=True)
    assert resumed.units_resumed == 0 and "retrained the tokenizer" in resumed.summary()
    reference = tmp_path / "reference"
    write_shards(final, retrained, reference, progress=False)
    assert tree_bytes(out) == tree_bytes(reference)
