"""Fast generation through ``unmask sample`` and ``complete()`` (docs/fast-generation.md): threshold
decoding, the prefix cache of semi-autoregressive blocks, whole-sequence blocks and their dual
cache, and unsupervised guidance on real
(untrained) exports; the exact settings give the plain samples, the costs are counted, and every
option that cannot apply is refused in one line naming its flag."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from common.errors import UserError
from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from evaluation.generation.generate import complete, generate
from model.sampling import SamplingPlan, ThresholdOptions
from pipeline.interchange.export import load_export
from tests.support.cli_runner import unmask_in_process
from tests.support.export_fixtures import EXPORT_VOCAB, LINES, write_untrained_export

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["the cat sat on", "a dog", "the cat sat on"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fast")
    tokenizer = train_sentencepiece(LINES, root / "tok", vocab_size=EXPORT_VOCAB)
    kinds = {"masked": ("diffusion", {}, {}), "uniform": ("diffusion", {"process": "uniform"},
                                                          {"time_conditioning": True}),
             "block": ("diffusion", {"block_size": 8}, {}), "ar": ("autoregressive", {}, {})}
    return {name: write_untrained_export(root / name, tokenizer, root / "tok", objective=objective, config=config,
                                         max_seq_len=32, **network)
            for name, (objective, config, network) in kinds.items()}


def _tokens(samples) -> list[list[int]]:
    return [sample.tokens for sample in samples]


def test_guidance_at_weight_zero_completes_as_the_conditional_model_at_twice_the_calls(exports):
    exported = load_export(exports["masked"])
    plan = SamplingPlan(sampler="first-hitting", seed=2)
    plain = complete(exported, plan, PROMPTS, max_new_tokens=6)
    guided = complete(exported, replace(plan, guidance=0.0), PROMPTS, max_new_tokens=6)
    assert _tokens(guided) == _tokens(plain)
    assert [s.network_calls for s in guided] == [2 * s.network_calls for s in plain] == [12] * 3
    stronger = complete(exported, replace(plan, guidance=4.0), PROMPTS, max_new_tokens=6, batch_size=1)
    assert _tokens(stronger) != _tokens(plain)
    assert _tokens(stronger) == _tokens(complete(exported, replace(plan, guidance=4.0), PROMPTS, max_new_tokens=6))


def test_a_prefix_cache_refreshed_every_call_samples_as_no_cache(exports):
    exported = load_export(exports["masked"])
    plan = SamplingPlan(sampler="confidence", steps=4, block_len=8, seed=1)
    plain = generate(exported, plan, num=3, seq_len=48, prompt="the cat")   # past max_seq_len 32: a window
    assert _tokens(generate(exported, replace(plan, prefix_cache=1), num=3, seq_len=48, prompt="the cat")) == \
        _tokens(plain)
    cached = generate(exported, replace(plan, prefix_cache=4), num=3, seq_len=48, prompt="the cat")
    assert [s.network_calls for s in cached] == [s.network_calls for s in plain]


def test_whole_sequence_blocks_and_the_dual_cache_from_the_command_line(exports, tmp_path):
    """The dual cache refreshed at every call samples as no cache; the plan records both options."""
    def sample(*flags: str) -> list[dict]:
        out = tmp_path / f"samples{''.join(flags)}.jsonl"
        assert unmask_in_process(["sample", str(exports["masked"]), "--num", "2", "--seq-len", "24", "--block-len",
                                  "8", "--sampler", "threshold", "--prompt", "the cat", "--whole-sequence", *flags,
                                  "--out", str(out)]) == 0
        return [json.loads(line) for line in out.read_text().splitlines()]
    plain, exact, cached = sample(), sample("--dual-cache", "1"), sample("--dual-cache", "3")
    assert plain[0]["plan"]["whole_sequence"] is True and "dual_cache" not in plain[0]["plan"]
    assert exact[0]["plan"]["dual_cache"] == 1 and cached[0]["plan"]["dual_cache"] == 3
    assert [r["tokens"] for r in exact] == [r["tokens"] for r in plain]
    assert [r["network_calls"] for r in exact] == [r["network_calls"] for r in plain]
    exported = load_export(exports["masked"])
    windowed = generate(exported, SamplingPlan(sampler="threshold", block_len=8), num=2, seq_len=24, prompt="the cat")
    assert _tokens(windowed) != [r["tokens"] for r in plain]   # the suffix changes what the network sees


def test_threshold_decoding_from_the_command_line(exports, tmp_path):
    out = tmp_path / "samples.jsonl"
    assert unmask_in_process(["sample", str(exports["masked"]), "--num", "2", "--seq-len", "24", "--sampler",
                              "threshold", "--sampler-option", "threshold=0.05", "--sampler-option", "max_tokens=6",
                              "--prompt", "the cat", "--guidance", "1.5", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["plan"]["options"] == {"threshold": 0.05, "min_tokens": 1, "max_tokens": 6,
                                             "score": "max-prob"}
    assert records[0]["plan"]["guidance"] == 1.5
    prompt_tokens = len(load_export(exports["masked"]).tokenizer.encode("the cat"))
    generated = 24 - prompt_tokens
    for record in records:   # two passes a call, at most 6 and at least 1 token a call
        assert 2 * -(-generated // 6) <= record["network_calls"] <= 2 * generated
    assert records == [json.loads(line) for line in out.read_text().splitlines()]
    plan = SamplingPlan(sampler="threshold", options=ThresholdOptions(threshold=0.05, max_tokens=6), guidance=1.5)
    again = generate(load_export(exports["masked"]), plan, num=2, seq_len=24, prompt="the cat")
    assert _tokens(again) == [record["tokens"] for record in records]


@pytest.mark.parametrize("kind, argv, message", [
    ("masked", ["--guidance", "1"], "--guidance guides generation towards a --prompt or --infill template"),
    ("masked", ["--prompt", "a", "--guidance", "-1"], "--guidance: guidance must be a number >= 0"),
    ("masked", ["--prefix-cache", "2"], ("--prefix-cache: prefix_cache caches the finished blocks' keys and values: "
                                         "it needs semi-autoregressive blocks")),
    ("masked", ["--block-len", "8", "--prefix-cache", "0"], "--prefix-cache: prefix_cache is the refresh interval"),
    ("masked", ["--block-len", "8", "--prefix-cache", "2", "--compile", "on"], "--compile on: the prefix cache"),
    ("masked", ["--sampler", "threshold", "--sampler-option", "threshold=2"],
     r"--sampler-option: threshold must lie in \[0, 1\]"),
    ("masked", ["--sampler", "threshold", "--steps", "4", "--grid", "cosine"],
     "--grid: the threshold sampler has no time grid"),
    ("uniform", ["--block-len", "8", "--prefix-cache", "2"], ("--prefix-cache: the ancestral sampler of this process "
                                                              "asks the network for every position")),
    ("uniform", ["--sampler", "threshold"], "--sampler threshold: the threshold sampler does not apply to the uniform"),
    ("block", ["--prefix-cache", "2", "--block-len", "8"], "--prefix-cache: a block diffusion export caches"),
    ("block", ["--prompt", "a", "--guidance", "1"], "--guidance: a block diffusion export holds the prompt"),
    ("ar", ["--prompt", "a", "--guidance", "1"], "--guidance needs a diffusion export"),
    ("masked", ["--whole-sequence"],
     "--whole-sequence: whole_sequence shows semi-autoregressive blocks the whole sequence: it needs blocks"),
    ("masked", ["--block-len", "8", "--dual-cache", "2"],
     "--dual-cache: dual_cache caches the keys and values of the prefix and of the masked suffix: it needs whole_seq"),
    ("masked", ["--block-len", "8", "--whole-sequence", "--dual-cache", "0"],
     "--dual-cache: dual_cache is the refresh interval"),
    ("masked", ["--block-len", "8", "--whole-sequence", "--dual-cache", "2", "--prefix-cache", "2"],
     "--dual-cache: dual_cache holds the prefix's keys and values already"),
    ("masked", ["--block-len", "8", "--whole-sequence", "--seq-len", "48"],
     "--whole-sequence shows the network all 48 positions, more than its max_seq_len 32"),
    ("masked", ["--block-len", "8", "--whole-sequence", "--dual-cache", "2", "--compile", "on"],
     "--compile on: the dual cache"),
    ("uniform", ["--block-len", "8", "--whole-sequence"],
     "--whole-sequence shows the network the suffix masked, which only an absorbing export has"),
    ("block", ["--block-len", "8", "--whole-sequence"], "--whole-sequence: a block diffusion export attends"),
])
def test_options_that_cannot_apply_are_refused_in_one_line_naming_the_flag(exports, capsys, kind, argv, message):
    assert unmask_in_process(["sample", str(exports[kind]), "--num", "1", "--seq-len", "16", *argv]) != 0
    err = capsys.readouterr().err
    assert re.search(message, err) and len(err.strip().splitlines()) == 1, err


def test_complete_refuses_guidance_on_a_block_export(exports):
    with pytest.raises(UserError, match="--guidance: a block diffusion export"):
        complete(load_export(exports["block"]), SamplingPlan(guidance=1.0, steps=2), ["a"], max_new_tokens=4)
