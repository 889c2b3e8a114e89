"""``unmask sample`` on real exports of untrained tiny networks (diffusion and autoregressive)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from data_prep.tokenizer import train_sentencepiece
from evaluation import generation
from evaluation.generation import Sample, build_prompt, generate
from model.diffusion import MaskedDiffusion
from model.schedules import make_schedule
from pipeline.export import Exported, load_export, resolve_export
from pipeline.run_layout import RunLayout
from tests.cli_runner import unmask_in_process
from tests.export_fixtures import write_untrained_export

VOCAB_SIZE = 320
MAX_SEQ_LEN = 64
SEQ_LEN = 32
PROMPT = "the cat sat on"
TEMPLATE = "the [MASK*4] sat on the [MASK*3]."
ANIMALS = ["cat", "dog", "fox", "owl", "bee", "yak", "emu", "ram"]
PLACES = ["mat", "log", "hill", "roof", "boat", "bench", "rug", "wall"]
SCHEDULE = {"schedule": "polynomial", "schedule_args": {"power": 2}}  # in the exports' configs


def _lines() -> list[str]:
    """A few hundred varied lines, enough for a 320-piece vocabulary."""
    return [f"the {ANIMALS[i % 8]} sat on the {PLACES[(i * 3) % 8]} at {i} past {i * 7 % 60}, "
            f"said {ANIMALS[(i * 5) % 8]}{'!' if i % 3 else '.'}" for i in range(400)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generation")
    tokenizer = train_sentencepiece(_lines(), root / "tok", vocab_size=VOCAB_SIZE)
    assert tokenizer.vocab_size == VOCAB_SIZE
    return {objective: write_untrained_export(RunLayout(root / name).export, tokenizer, root / "tok",
                                              objective=objective, config=SCHEDULE, max_seq_len=MAX_SEQ_LEN)
            for name, objective in (("run", "diffusion"), ("ar", "autoregressive"))}


@pytest.fixture
def diffusion(exports) -> Exported:
    return load_export(exports["diffusion"])


@pytest.fixture
def autoregressive(exports) -> Exported:
    return load_export(exports["autoregressive"])


# ------------------------------------------------------------------ conditioning
def test_prompt_tokens_are_kept_at_the_start(diffusion):
    prefix = diffusion.tokenizer.encode(PROMPT)
    samples = generate(diffusion, num=3, steps=20, seq_len=SEQ_LEN, prompt=PROMPT, batch_size=2)
    assert len(samples) == 3
    for sample in samples:
        assert sample.tokens[:len(prefix)] == prefix
        assert len(sample.tokens) == SEQ_LEN and max(sample.tokens) < VOCAB_SIZE  # no mask left
        assert sample.text.startswith(PROMPT)
        assert (sample.prompt, sample.steps) == (PROMPT, 20)


def test_infill_keeps_the_literal_segments_in_place_and_fills_the_spans(diffusion):
    tokenizer = diffusion.tokenizer
    mask_id = VOCAB_SIZE
    conditioning = build_prompt(tokenizer, SEQ_LEN, mask_id, infill=TEMPLATE)
    first, second, third = (tokenizer.encode(s) for s in ("the ", " sat on the ", "."))
    expected = first + [mask_id] * 4 + second + [mask_id] * 3 + third
    assert conditioning.tolist() == expected + [mask_id] * (SEQ_LEN - len(expected))
    single = tokenizer.encode("a ") + [mask_id] + tokenizer.encode(" b")  # [MASK] alone is one position
    assert build_prompt(tokenizer, SEQ_LEN, mask_id, infill="a [MASK] b").tolist()[:len(single) + 1] == \
        single + [mask_id]

    kept = [i for i, token in enumerate(expected) if token != mask_id]
    for sample in generate(diffusion, num=4, steps=16, seq_len=SEQ_LEN, infill=TEMPLATE, seed=3):
        assert [sample.tokens[i] for i in kept] == [expected[i] for i in kept]
        assert mask_id not in sample.tokens
        # The spans and the positions after the template are generated; the literals stay.
        assert re.match(r"the .+ sat on the .+\.", sample.text, flags=re.S), sample.text
        assert sample.prompt == TEMPLATE


def test_no_conditioning_gives_no_prompt_tensor(diffusion):
    assert build_prompt(diffusion.tokenizer, SEQ_LEN, VOCAB_SIZE) is None
    sample = generate(diffusion, num=1, steps=8, seq_len=SEQ_LEN)[0]
    assert sample.prompt is None and len(sample.tokens) == SEQ_LEN


def test_text_stops_at_the_first_eos_after_the_prompt(diffusion):
    tokenizer = diffusion.tokenizer
    prefix = tokenizer.encode(PROMPT)
    tokens = prefix + tokenizer.encode(" a") + [tokenizer.eos_id] + tokenizer.encode("b")
    tokens += [tokenizer.eos_id] * (SEQ_LEN - len(tokens))
    sample = generation._sample(tokenizer, tokens, len(prefix), 1, 1, PROMPT)
    assert sample.text == PROMPT + " a" and sample.tokens == tokens


# ------------------------------------------------------------------ determinism and cost
def test_same_seed_same_samples_other_seed_other_samples(diffusion):
    def draw(seed: int) -> list[Sample]:
        return generate(diffusion, num=3, steps=12, seq_len=SEQ_LEN, prompt=PROMPT, top_p=0.9,
                        grid="cosine", seed=seed, batch_size=2)

    assert draw(0) == draw(0)
    assert [s.tokens for s in draw(0)] != [s.tokens for s in draw(1)]


def test_network_calls_stay_below_seq_len_at_many_steps(diffusion):
    seq_len, steps = 8, 1000
    samples = generate(diffusion, num=2, steps=steps, seq_len=seq_len, batch_size=1)
    assert all(1 <= s.network_calls <= seq_len and s.steps == steps for s in samples)
    # Batched, each sample is charged its batch's share of rows evaluated: the same bound.
    batched = generate(diffusion, num=3, steps=steps, seq_len=seq_len, batch_size=3)
    assert all(1 <= s.network_calls <= seq_len for s in batched)


def test_network_calls_are_the_samplers_rows_evaluated_for_one_row(diffusion):
    sample = generate(diffusion, num=1, steps=500, seq_len=SEQ_LEN, seed=5, batch_size=1)[0]
    sampler = MaskedDiffusion(make_schedule("polynomial", power=2), VOCAB_SIZE)
    with torch.no_grad():
        tokens, stats = sampler.sample(diffusion.network, 1, SEQ_LEN, 500, torch.Generator().manual_seed(5),
                                       return_stats=True)
    assert sample.tokens == tokens[0].tolist()
    assert sample.network_calls == stats.rows_evaluated == stats.network_calls


# ------------------------------------------------------------------ command line
def test_jsonl_output_round_trips(exports, diffusion, tmp_path, capsys):
    out = tmp_path / "samples.jsonl"
    run_dir = exports["diffusion"].parent  # a run directory: RUN/export is used
    assert unmask_in_process(["sample", str(run_dir), "--num", "3", "--steps", "10", "--seq-len", str(SEQ_LEN),
                              "--prompt", PROMPT, "--seed", "2", "--batch-size", "2", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    expected = generate(diffusion, num=3, steps=10, seq_len=SEQ_LEN, prompt=PROMPT, seed=2, batch_size=2)
    quality = {"unigram_entropy", "reference_nll", "reference_tokens"}
    assert [Sample(**{k: v for k, v in record.items() if k not in quality}) for record in records] == expected
    assert set(records[0]) == {"text", "tokens", "text_tokens", "network_calls", "steps", "grid", "top_p", "seed",
                               "prompt"} | quality
    assert (records[0]["grid"], records[0]["top_p"], records[0]["seed"]) == ("uniform", None, 2)
    printed = capsys.readouterr().out
    assert "wrote 3 samples" in printed and "mean unigram entropy:" in printed


def test_text_output_has_one_block_per_sample(exports, diffusion, capsys):
    assert unmask_in_process(["sample", str(exports["diffusion"]), "--num", "2", "--steps", "6", "--seq-len",
                              "12", "--prompt", PROMPT]) == 0
    printed = capsys.readouterr().out
    expected = generate(diffusion, num=2, steps=6, seq_len=12, prompt=PROMPT)
    headers = re.findall(r"^----- sample (\d+) \(network calls: (\d+)\) -----$", printed, flags=re.M)
    assert headers == [(str(i + 1), str(s.network_calls)) for i, s in enumerate(expected)]
    for sample in expected:
        assert sample.text in printed


def test_help_documents_the_placeholder_syntax(capsys):
    with pytest.raises(SystemExit):
        unmask_in_process(["sample", "--help"])
    help_text = capsys.readouterr().out
    assert "[MASK*n]" in help_text and "examples:" in help_text


def test_prompt_and_infill_are_exclusive_on_the_command_line(exports, capsys):
    with pytest.raises(SystemExit):
        unmask_in_process(["sample", str(exports["diffusion"]), "--num", "1", "--steps", "2", "--prompt", "a",
                           "--infill", "[MASK]"])
    assert "--prompt" in capsys.readouterr().err


def test_resolve_export(exports, tmp_path):
    export_dir = exports["diffusion"]
    assert resolve_export(export_dir) == export_dir
    assert resolve_export(export_dir.parent) == export_dir
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError, match=r"unmask export"):
        resolve_export(tmp_path / "run")
    with pytest.raises(UserError, match=r"neither an export"):
        resolve_export(tmp_path)


# ------------------------------------------------------------------ errors name the flag
@pytest.mark.parametrize("arguments, message", [
    ({"infill": "the [MASK*x] sat"}, r"--infill has a malformed placeholder near '\[MASK\*x\] s"),
    ({"infill": "the [MASK*2 sat"}, r"--infill has a malformed placeholder"),
    ({"infill": "the [MASK*0] sat"}, r"--infill placeholder '\[MASK\*0\]'"),
    ({"infill": "a [MASK*40] b"}, r"--infill is \d+ tokens .* longer than --seq-len 32"),
    ({"infill": "a [MASK*10000000000] b"}, r"--infill is \d+ tokens"),
    ({"prompt": "a", "infill": "[MASK]"}, r"--prompt and --infill are exclusive"),
    ({"prompt": "the cat sat on the mat " * 8}, r"--prompt is \d+ tokens, longer than --seq-len"),
    ({"top_p": 0.0}, r"--top-p must lie in \(0, 1\]"),
    ({"top_p": 1.5}, r"--top-p"),
    ({"num": 0}, r"--num must be an integer >= 1"),
    ({"steps": 0}, r"--steps must be an integer >= 1"),
    ({"steps": None}, r"--steps is required"),
    ({"batch_size": 0}, r"--batch-size"),
    ({"seq_len": MAX_SEQ_LEN + 1}, r"--seq-len 65 exceeds the network's max_seq_len 64"),
    ({"grid": "linear"}, r"--grid must be one of"),
    ({"device": "nonsense"}, r"--device"),
])
def test_bad_arguments_name_the_flag(diffusion, arguments, message):
    call = {"num": 1, "steps": 4, "seq_len": SEQ_LEN, **arguments}
    with pytest.raises(UserError, match=message):
        generate(diffusion, **call)


def test_a_template_without_room_to_generate_is_refused(diffusion):
    text = "the cat sat on the mat"
    length = len(diffusion.tokenizer.encode(text))
    with pytest.raises(UserError, match=rf"--infill fills all {length} positions .* nothing is left"):
        build_prompt(diffusion.tokenizer, length, VOCAB_SIZE, infill=text)


# ------------------------------------------------------------------ autoregressive exports
def test_autoregressive_sampling_keeps_the_prefix_and_is_deterministic(autoregressive):
    prefix = autoregressive.tokenizer.encode(PROMPT)
    samples = generate(autoregressive, num=3, steps=None, seq_len=SEQ_LEN, prompt=PROMPT, seed=4,
                       batch_size=2, top_p=0.95)
    assert samples == generate(autoregressive, num=3, steps=None, seq_len=SEQ_LEN, prompt=PROMPT, seed=4,
                               batch_size=2, top_p=0.95)
    assert [s.tokens for s in samples] != [s.tokens for s in generate(
        autoregressive, num=3, steps=None, seq_len=SEQ_LEN, prompt=PROMPT, seed=5, batch_size=2, top_p=0.95)]
    for sample in samples:
        assert sample.tokens[:len(prefix)] == prefix and sample.text.startswith(PROMPT)
        assert sample.network_calls == sample.steps == SEQ_LEN - len(prefix)


def test_autoregressive_tokens_follow_the_network_left_to_right(autoregressive):
    """With a tiny nucleus the draw is greedy: each token is the argmax given the ones before."""
    samples = generate(autoregressive, num=2, steps=None, seq_len=SEQ_LEN, top_p=1e-9)
    tokens = torch.tensor([s.tokens for s in samples])
    start = torch.full((2, 1), VOCAB_SIZE)
    with torch.no_grad():
        logits = autoregressive.network(torch.cat([start, tokens[:, :-1]], dim=1))
    assert torch.equal(logits.argmax(-1), tokens)


def test_autoregressive_exports_cannot_infill(autoregressive):
    with pytest.raises(UserError, match=r"--infill needs a diffusion export"):
        generate(autoregressive, num=1, steps=None, seq_len=SEQ_LEN, infill=TEMPLATE)
