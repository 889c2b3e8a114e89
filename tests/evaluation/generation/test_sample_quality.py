"""Sample quality: unigram entropy, and generative perplexity under an unmask AR export or a Hugging
Face causal LM on disk, checked against the reference models' likelihoods computed here; and the
``unmask sample`` / ``unmask eval`` output that records them with the sampling settings."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace

import pytest
import torch

from common.errors import UserError
from data_prep.tokenizer.load import load_tokenizer
from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from evaluation.bounds.scoring import ScoringConfig
from evaluation.generation.generate import generate
from evaluation.generation.sample_quality import (
    HF_KIND,
    UNMASK_KIND,
    check_reference,
    load_reference,
    score_samples,
    unigram_entropy,
)
from evaluation.zero_shot import ReportOptions, is_up_to_date
from model.sampling import ConfidenceOptions, SamplingPlan
from pipeline.interchange.export import load_export
from tests.support.cli_runner import unmask_in_process
from tests.support.export_fixtures import write_untrained_export
from tests.support.paths import GPT2, needs_shared
from tests.support.tokenizer_fixtures import reference_gpt2

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB_SIZE = 320
SEQ_LEN = 48
SHORT_CONTEXT = 16  # an AR reference shorter than the samples: scored in windows
ENDOFTEXT = "<|endoftext|>"


def _lines() -> list[str]:
    return [f"the {word} number {i} sat on the mat at {i * 7 % 60} past, said the {word}"
            for i, word in enumerate(["cat", "dog", "fox", "owl", "bee", "yak", "emu", "ram"] * 50)]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    tokenizer = train_sentencepiece(_lines(), root / "tok", vocab_size=VOCAB_SIZE)
    made = {name: write_untrained_export(root / name / "export", tokenizer, root / "tok", objective=objective,
                                         max_seq_len=max_seq_len)
            for name, objective, max_seq_len in (("diffusion", "diffusion", 64), ("ar", "autoregressive", 64),
                                                 ("short-ar", "autoregressive", SHORT_CONTEXT))}
    if GPT2.is_dir():  # for the tests marked needs_shared("gpt2-bpe")
        made["gpt2-ar"] = write_untrained_export(root / "gpt2-ar" / "export", load_tokenizer(GPT2), GPT2,
                                                 objective="autoregressive", max_seq_len=64)
    return made


@pytest.fixture(scope="module")
def samples(exports):
    exported = load_export(exports["diffusion"])
    return exported, generate(exported, SamplingPlan(steps=16, seed=1), num=3, seq_len=SEQ_LEN, batch_size=3)


def exact_nll(network, ids: list[int], start: int) -> float:
    """-log p(ids) of a causal network read from ``start``, by log-softmax over its logits."""
    tokens = torch.tensor([[start, *ids]])
    with torch.no_grad():
        logits = network(tokens[:, :-1], None)
    return -float(torch.log_softmax(logits.double(), -1)[0].gather(-1, tokens[0, 1:, None]).sum())


def test_unigram_entropy():
    assert unigram_entropy([]) == 0.0 and unigram_entropy([7] * 10) == 0.0
    assert unigram_entropy([1, 1, 2, 2]) == pytest.approx(math.log(2))
    assert unigram_entropy([1, 2, 3, 4]) == pytest.approx(math.log(4))
    assert unigram_entropy([1, 1, 1, 2]) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


def test_a_reference_with_the_samplers_tokenizer_scores_the_sampled_tokens(exports, samples):
    exported, drawn = samples
    reference = load_reference(exports["ar"])
    quality = score_samples(drawn, exported.tokenizer, reference)
    network, start = load_export(exports["ar"]).network, VOCAB_SIZE
    expected = [exact_nll(network, sample.tokens[:sample.text_tokens], start) for sample in drawn]
    assert [score.reference_nll for score in quality.scores] == pytest.approx(expected, rel=1e-5)
    assert [score.reference_tokens for score in quality.scores] == [sample.text_tokens for sample in drawn]
    perplexity = quality.generative_perplexity
    assert (perplexity.retokenized, perplexity.reference_kind) == (False, UNMASK_KIND)
    assert perplexity.perplexity == pytest.approx(math.exp(sum(expected) / perplexity.tokens), rel=1e-5)
    entropies = [unigram_entropy(sample.tokens[:sample.text_tokens]) for sample in drawn]
    assert quality.mean_unigram_entropy == pytest.approx(sum(entropies) / len(entropies))


def test_a_text_longer_than_the_reference_is_scored_window_by_window(exports, samples):
    exported, drawn = samples
    longest = max(drawn, key=lambda sample: sample.text_tokens)
    assert longest.text_tokens > SHORT_CONTEXT
    quality = score_samples([longest], exported.tokenizer, load_reference(exports["short-ar"]))
    network, ids = load_export(exports["short-ar"]).network, longest.tokens[:longest.text_tokens]
    windows = [exact_nll(network, ids[start:start + SHORT_CONTEXT], VOCAB_SIZE)
               for start in range(0, len(ids), SHORT_CONTEXT)]
    assert quality.scores[0].reference_nll == pytest.approx(sum(windows), rel=1e-5)


@needs_shared("gpt2-bpe")
def test_a_reference_with_another_tokenizer_scores_the_retokenized_text(exports, samples):
    exported, drawn = samples
    quality = score_samples(drawn, exported.tokenizer, load_reference(exports["gpt2-ar"]))
    gpt2 = load_tokenizer(GPT2)
    assert quality.generative_perplexity.retokenized
    assert [score.reference_tokens for score in quality.scores] == [len(gpt2.encode(s.text)) for s in drawn]


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    """A one-layer GPT-2 causal LM with GPT-2's tokenizer, saved as Hugging Face saves it."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: the Hugging Face "
                                                              "reference path is optional")
    path = tmp_path_factory.mktemp("hf-gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_positions=SHORT_CONTEXT + 1, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(path, safe_serialization=True)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=reference_gpt2(), bos_token=ENDOFTEXT,
                                                     eos_token=ENDOFTEXT)
    tokenizer.save_pretrained(path)
    return path


@needs_shared("gpt2-bpe")
def test_a_hugging_face_causal_lm_scores_the_retokenized_text_from_its_bos(hf_model_dir, samples):
    import transformers

    exported, drawn = samples
    reference = load_reference(hf_model_dir)
    quality = score_samples(drawn, exported.tokenizer, reference)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir).eval()
    gpt2 = load_tokenizer(GPT2)
    expected = []
    for sample in drawn:
        ids = gpt2.encode(sample.text)  # the same BPE: HF's tokenizer must give these ids
        windows = [ids[start:start + SHORT_CONTEXT] for start in range(0, len(ids), SHORT_CONTEXT)]
        expected.append(sum(exact_nll(lambda x, _: model(x).logits, window, gpt2.eos_id) for window in windows))
    assert [score.reference_nll for score in quality.scores] == pytest.approx(expected, rel=1e-4)
    perplexity = quality.generative_perplexity
    assert (perplexity.reference_kind, perplexity.retokenized) == (HF_KIND, True)
    assert perplexity.reference == str(hf_model_dir)


def test_a_hugging_face_reference_without_transformers_says_how_to_install_it(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))  # how HF names a model directory
    monkeypatch.setitem(sys.modules, "transformers", None)  # importing it now raises ImportError
    with pytest.raises(UserError, match=r"Hugging Face model directory: install transformers .*pip install"):
        load_reference(tmp_path)


def test_reference_errors_name_the_flag(exports, tmp_path):
    with pytest.raises(UserError, match=r"--reference .*nowhere does not exist"):
        load_reference(tmp_path / "nowhere")
    with pytest.raises(UserError, match=r"a diffusion export; generative perplexity needs an autoregressive one"):
        load_reference(exports["diffusion"])


def test_a_reference_run_without_an_export_says_to_export_it(tmp_path):
    run = tmp_path / "ar-run"
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    with pytest.raises(UserError, match=rf"--reference {run}: a training run without an export; "
                                        rf"run `unmask export {run}` first"):
        check_reference(run)


# ------------------------------------------------------------------ the command lines
def test_unmask_sample_records_settings_and_quality_in_the_jsonl(exports, tmp_path, capsys):
    out = tmp_path / "samples.jsonl"
    assert unmask_in_process(["sample", str(exports["diffusion"]), "--num", "2", "--steps", "12", "--seq-len",
                              str(SEQ_LEN), "--grid", "cosine", "--top-p", "0.9", "--seed", "5", "--reference",
                              str(exports["ar"]), "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [SamplingPlan.from_dict(r["plan"]) for r in records] == [SamplingPlan(steps=12, grid="cosine", top_p=0.9,
                                                                                 seed=5)] * 2
    for record in records:
        assert record["unigram_entropy"] == pytest.approx(
            unigram_entropy(record["tokens"][:record["text_tokens"]]))
        assert record["reference_tokens"] == record["text_tokens"] and record["reference_nll"] > 0
    nll = sum(r["reference_nll"] for r in records) / sum(r["reference_tokens"] for r in records)
    printed = capsys.readouterr().out
    assert f"generative perplexity: {math.exp(nll):.3f} under {exports['ar']}" in printed
    assert "the sampled tokens: the reference shares the tokenizer" in printed


@needs_shared("gpt2-bpe")
def test_unmask_eval_reports_generative_perplexity_and_entropy(exports, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("\n\n".join(_lines()[:40]), encoding="utf-8")
    out = tmp_path / "report"
    assert unmask_in_process(["eval", str(exports["diffusion"]), "--datasets", str(text), "--samples", "2",
                              "--num-samples", "2", "--sampler", "confidence", "--sample-steps", "12",
                              "--sample-grid", "cosine", "--sample-top-p", "0.9", "--sampler-option", "score=margin",
                              "--reference", str(exports["gpt2-ar"]), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    sampling = results["sampling"]
    plan = SamplingPlan(sampler="confidence", steps=12, grid="cosine", top_p=0.9,
                        options=ConfidenceOptions(score="margin"))
    assert SamplingPlan.from_dict(sampling["plan"]) == plan
    assert (sampling["num_samples"], sampling["seq_len"], sampling["mean_network_calls"]) == (2, 64, 12)
    entropies = [sample["unigram_entropy"] for sample in results["samples"]]
    assert sampling["mean_unigram_entropy"] == pytest.approx(sum(entropies) / 2)
    perplexity = sampling["generative_perplexity"]
    assert perplexity["retokenized"] and perplexity["tokens"] == sum(s["reference_tokens"] for s in results["samples"])
    markdown = (out / "report.md").read_text(encoding="utf-8")
    assert f"2 samples of 64 tokens: {plan.describe()}. They needed 12.0 network calls each" in markdown
    assert f"Mean unigram entropy: {sampling['mean_unigram_entropy']:.3f} nats" in markdown
    assert (f"Generative perplexity: {perplexity['perplexity']:,.2f} under the unmask-export model "
            f"`{exports['gpt2-ar']}`, over {perplexity['tokens']:,} tokens: the decoded text re-encoded with the "
            f"reference's tokenizer") in markdown
    assert "generative perplexity" in capsys.readouterr().out


def test_unmask_eval_sweeps_every_sampler_over_the_budgets(exports, tmp_path):
    """--sample-sweep: every sampler of the process at 16 to 1024 network calls, scored by the
    reference, in results.json, the report's table and its plot."""
    text = tmp_path / "notes.txt"
    text.write_text("\n\n".join(_lines()[:10]), encoding="utf-8")
    out = tmp_path / "report"
    assert unmask_in_process(["eval", str(exports["diffusion"]), "--datasets", str(text), "--samples", "2",
                              "--num-samples", "2", "--sampler", "first-hitting", "--sample-sweep",
                              "--reference", str(exports["ar"]), "--out", str(out)]) == 0
    config, plan = ScoringConfig(datasets=(str(text),), samples_per_block=2), SamplingPlan(sampler="first-hitting")
    options = ReportOptions(num_samples=2, sampling=plan, sample_sweep=True, out=out)
    assert is_up_to_date(exports["diffusion"], config, options)  # unmask run would skip it...
    assert not is_up_to_date(exports["diffusion"], config, replace(options, sampling=replace(plan, seed=1)))
    assert not is_up_to_date(exports["diffusion"], config, replace(options, sample_sweep=False))  # ...not these
    sweep = json.loads((out / "results.json").read_text(encoding="utf-8"))["sampling"]["sweep"]
    budgets = (16, 32, 64, 128, 256, 1024)
    assert [(row["sampler"], row["budget"]) for row in sweep] == [
        (sampler, budget) for sampler in ("ancestral", "first-hitting", "confidence", "remdm", "threshold") for budget in budgets]
    for row in sweep:
        assert 1 <= row["network_calls"] <= min(row["budget"], 64 if row["sampler"] != "remdm" else row["budget"])
        assert row["generative_perplexity"] > 1 and row["mean_unigram_entropy"] > 0
    exact = [row["network_calls"] for row in sweep if row["sampler"] == "first-hitting"]
    assert exact == [16, 32, 64, 64, 64, 64]  # k tokens per call below 64, one per token from 64 on
    markdown = (out / "report.md").read_text(encoding="utf-8")
    assert "### Quality per network call" in markdown and "| remdm | 1,024 |" in markdown
    assert (out / "plots" / "sampler_sweep.png").stat().st_size > 1000


def test_unmask_eval_refuses_a_reference_without_samples(exports, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("a few words\n", encoding="utf-8")
    assert unmask_in_process(["eval", str(exports["diffusion"]), "--datasets", str(text),
                              "--reference", str(exports["ar"])]) == 2
    assert "--reference scores the report's samples: give --num-samples N too" in capsys.readouterr().err
