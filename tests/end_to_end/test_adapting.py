"""Adapting a GPT-2 directory as a user does it, every command after the model is saved: prep
with its tokenizer.json, `unmask train --init-from DIR` into block diffusion (annealing), export
in both formats (transformers loads the HF one and gives our logits), sample with every sampler,
eval on the shards and under the MDLM protocol (its report naming the source), lm-eval, and a
new run from the adapted export; a Llama directory adapted to MDLM and sampled; data of another
tokenizer is refused in one line (docs/adapting.md)."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.interchange.export import load_export
from pipeline.run_dir.checkpoint import read_state, resolve_checkpoint
from tests.support.causal_lm_fixtures import VOCAB_SIZE, write_causal_lm
from tests.support.cli_runner import run_unmask, unmask_in_process
from tests.support.paths import SHARED, TINY, needs_shared
from tests.support.train_helpers import run_train, write_config

pytestmark = [pytest.mark.slow, needs_shared("corpora/tinyshakespeare/input.txt", "ptb/ptb.valid.txt")]
SAMPLERS = ("ancestral", "confidence", "remdm")   # first-hitting: the subprocess above

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
    for sampler in SAMPLERS:   # in this process: no interpreter start per command
        assert unmask_in_process(["sample", str(tmp_path / "export"), "--num", "2", "--seq-len", "16", "--sampler",
                                  sampler, "--steps", "4", "--out", str(tmp_path / f"{sampler}.jsonl")]) == 0
        assert len((tmp_path / f"{sampler}.jsonl").read_text().splitlines()) == 2, sampler
    assert unmask_in_process(["eval", str(tmp_path / "export"), "--datasets", "ptb", "--data-dir", str(SHARED),
                              "--protocol", "mdlm", "--seq-len", "32", "--max-documents", "4", "--samples", "2",
                              "--out", str(tmp_path / "eval-mdlm")]) == 0
    results = json.loads((tmp_path / "eval-mdlm" / "results.json").read_text(encoding="utf-8"))
    assert results["protocol"]["name"] == "mdlm" and results["datasets"]["ptb"]["num_tokens"] > 0
    assert results["model"]["init_from"]["family"] == "gpt2"
    assert unmask_in_process(["lm-eval", str(tmp_path / "export"), "--tasks", "ptb_word_order", "--limit", "2",
                              "--data-dir", str(SHARED), "--samples", "2", "--out", str(tmp_path / "lm-eval")]) == 0
    # transformers loads the HF export (the family layers and the shift in its modeling file): our logits.
    _ok(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")])
    import transformers

    hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    network = load_export(tmp_path / "export").network.eval()
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, VOCAB_SIZE, (2, 64), generator=generator)
    z = torch.where(torch.rand(2, 64, generator=generator) < 0.5, VOCAB_SIZE, x0)   # id V: the mask
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=z, clean_ids=x0).logits,
                                   network(z, None, clean=x0, block_size=8), rtol=0, atol=1e-5)
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


def test_a_llama_directory_is_adapted_to_mdlm_and_samples(tmp_path, gpt2_shards):
    """Llama's layers (RMSNorm, SwiGLU, grouped-query attention, RoPE) through the command line:
    the fixtures' tokenizer is the GPT-2 directory's, so its shards serve."""
    _, shards = gpt2_shards
    source = write_causal_lm(tmp_path / "llama", "llama")
    mdlm = {**ADAPT, "model": {"n_layers": None, "d_model": None, "n_heads": None}}
    run = run_train(tmp_path / "run", shards, write_config(tmp_path / "adapt.yaml", mdlm),
                    extra=["--init-from", str(source)])
    record = read_state(resolve_checkpoint(run.run_dir)).init_from
    assert record["family"] == "llama" and record["adaptation"]["target"] == "MDLM"
    _ok(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")])
    assert unmask_in_process(["sample", str(tmp_path / "export"), "--num", "2", "--seq-len", "24", "--out",
                              str(tmp_path / "samples.jsonl")]) == 0
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 2
