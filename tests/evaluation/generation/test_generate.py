"""``unmask sample`` (``evaluation.generation.generate``) on real exports of untrained tiny networks
(diffusion, autoregressive, block diffusion past its context): conditioning, determinism and
cost, the command line, errors naming the flag, compiling, and every kind of export sampling on
a (pretend) device as on the host."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from common.errors import UserError
from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
from evaluation.generation import generate as generation
from evaluation.generation.generate import Sample, build_prompt, complete, generate
from model.absorbing import AbsorbingDiffusion
from model.sampling import RemaskOptions, SamplingPlan, sample_generators
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig
from pipeline.interchange.export import Exported, load_export, resolve_export
from pipeline.run_dir.layout import RunLayout
from tests.support.cli_refusals import one_line_error
from tests.support.cli_runner import unmask_in_process
from tests.support.export_fixtures import EXPORT_LENGTH, write_untrained_export
from tests.support.fake_device import DEVICE, on_fake_device

VOCAB_SIZE = 320
MAX_SEQ_LEN = 64
SEQ_LEN = 32
PROMPT = "the cat sat on"
TEMPLATE = "the [MASK*4] sat on the [MASK*3]."
ANIMALS = ["cat", "dog", "fox", "owl", "bee", "yak", "emu", "ram"]
PLACES = ["mat", "log", "hill", "roof", "boat", "bench", "rug", "wall"]
SCHEDULE = {"schedule": "polynomial", "schedule_args": {"power": 2}}  # in the exports' configs
PLANS = {"ancestral": SamplingPlan(steps=12, grid="cosine", top_p=0.9),
         "first-hitting": SamplingPlan(sampler="first-hitting", temperature=0.8),
         "confidence": SamplingPlan(sampler="confidence", steps=6),
         "remdm": SamplingPlan(sampler="remdm", steps=16, options=RemaskOptions(schedule="rescale", eta=0.5))}


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
    exports = {objective: write_untrained_export(RunLayout(root / name).export, tokenizer, root / "tok",
                                                 objective=objective, config=SCHEDULE, max_seq_len=MAX_SEQ_LEN)
               for name, objective in (("run", "diffusion"), ("ar", "autoregressive"))}
    exports["uniform"] = write_untrained_export(RunLayout(root / "uniform").export, tokenizer, root / "tok",
                                                config={"process": "uniform"}, max_seq_len=MAX_SEQ_LEN,
                                                time_conditioning=True)
    return exports


@pytest.fixture
def diffusion(exports) -> Exported:
    return load_export(exports["diffusion"])


@pytest.fixture
def autoregressive(exports) -> Exported:
    return load_export(exports["autoregressive"])


# ------------------------------------------------------------------ conditioning
def test_prompt_tokens_are_kept_at_the_start(diffusion):
    prefix = diffusion.tokenizer.encode(PROMPT)
    plan = SamplingPlan(steps=20)
    samples = generate(diffusion, plan, num=3, seq_len=SEQ_LEN, prompt=PROMPT, batch_size=2)
    assert len(samples) == 3
    for index, sample in enumerate(samples):
        assert sample.tokens[:len(prefix)] == prefix
        assert len(sample.tokens) == SEQ_LEN and max(sample.tokens) < VOCAB_SIZE  # no mask left
        assert sample.text.startswith(PROMPT)
        assert (sample.prompt, sample.plan, sample.index) == (PROMPT, plan, index)


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
    for sample in generate(diffusion, SamplingPlan(steps=16, seed=3), num=4, seq_len=SEQ_LEN, infill=TEMPLATE):
        assert [sample.tokens[i] for i in kept] == [expected[i] for i in kept]
        assert mask_id not in sample.tokens
        # The spans and the positions after the template are generated; the literals stay.
        assert re.match(r"the .+ sat on the .+\.", sample.text, flags=re.S), sample.text
        assert sample.prompt == TEMPLATE


def test_no_conditioning_gives_no_prompt_tensor(diffusion):
    assert build_prompt(diffusion.tokenizer, SEQ_LEN, VOCAB_SIZE) is None
    sample = generate(diffusion, SamplingPlan(steps=8), num=1, seq_len=SEQ_LEN)[0]
    assert sample.prompt is None and len(sample.tokens) == SEQ_LEN


def test_text_stops_at_the_first_eos_after_the_prompt(diffusion):
    tokenizer = diffusion.tokenizer
    prefix = tokenizer.encode(PROMPT)
    tokens = prefix + tokenizer.encode(" a") + [tokenizer.eos_id] + tokenizer.encode("b")
    tokens += [tokenizer.eos_id] * (SEQ_LEN - len(tokens))
    sample = generation._sample(tokenizer, tokens, len(prefix), 1, PROMPT, SamplingPlan(), 0)
    assert sample.text == PROMPT + " a" and sample.tokens == tokens


# ------------------------------------------------------------------ determinism and cost
@pytest.mark.parametrize("name", PLANS)
def test_a_sample_depends_on_the_seed_and_its_index_never_on_the_batch_size(diffusion, name):
    def draw(plan: SamplingPlan, batch_size: int) -> list[Sample]:
        return generate(diffusion, plan, num=5, seq_len=SEQ_LEN, prompt=PROMPT, batch_size=batch_size)

    plan = PLANS[name]
    batched = draw(plan, 2)
    assert batched == draw(plan, 5) == draw(plan, 1)  # tokens, text, network calls, plan, index
    assert [s.tokens for s in batched] != [s.tokens for s in draw(replace(plan, seed=1), 2)]
    assert all(1 <= s.network_calls <= (plan.steps or SEQ_LEN) for s in batched)


def test_network_calls_stay_below_seq_len_at_many_steps(diffusion):
    seq_len, steps = 8, 1000
    samples = generate(diffusion, SamplingPlan(steps=steps), num=3, seq_len=seq_len, batch_size=3)
    assert all(1 <= s.network_calls <= seq_len for s in samples)


def test_samples_and_calls_are_the_samplers_for_their_index(diffusion):
    plan = SamplingPlan(steps=500, seed=5)
    samples = generate(diffusion, plan, num=3, seq_len=SEQ_LEN, batch_size=2)
    sampler = AbsorbingDiffusion(make_schedule("polynomial", power=2), VOCAB_SIZE)
    with torch.no_grad():
        tokens, stats = sampler.sample(diffusion.network, plan, num_samples=1, seq_len=SEQ_LEN,
                                       generator=sample_generators(5, [2]))
    assert samples[2].tokens == tokens[0].tolist() and samples[2].network_calls == stats.row_calls[0]


def test_blocks_generate_beyond_the_networks_context(diffusion):
    prefix = diffusion.tokenizer.encode(PROMPT)
    plan = SamplingPlan(sampler="first-hitting", block_len=16)
    samples = generate(diffusion, plan, num=2, seq_len=MAX_SEQ_LEN + 40, prompt=PROMPT)
    for sample in samples:
        assert len(sample.tokens) == MAX_SEQ_LEN + 40 and max(sample.tokens) < VOCAB_SIZE
        assert sample.tokens[:len(prefix)] == prefix
        assert sample.network_calls == MAX_SEQ_LEN + 40 - len(prefix)  # exact: one call per generated token


# ------------------------------------------------------------------ one continuation per prompt
@pytest.mark.parametrize("objective", ["diffusion", "autoregressive"])
def test_complete_continues_each_prompt_as_generate_would_its_sample(exports, objective):
    """What an evaluation harness calls: prompt i's continuation is sample i of the seed, the
    same as ``generate``'s sample i with that prompt, whatever the other prompts and the batch."""
    exported = load_export(exports[objective])
    prompts = ["the cat sat on", "a", "the dog", "the cat sat on"]
    plan = SamplingPlan(sampler="first-hitting" if objective == "diffusion" else "ancestral", seed=3)
    samples = complete(exported, plan, prompts, max_new_tokens=6, batch_size=3)
    assert samples == complete(exported, plan, prompts, max_new_tokens=6, batch_size=1)
    for index, (text, sample) in enumerate(zip(prompts, samples)):
        length = len(exported.tokenizer.encode(text)) + 6
        assert sample.index == index and sample.prompt == text and len(sample.tokens) == length
        alone = generate(exported, plan, num=index + 1, seq_len=length, prompt=text)[index]
        assert alone.tokens == sample.tokens and alone.network_calls == sample.network_calls == 6
    assert samples[0].tokens != samples[3].tokens  # the same prompt, another generator
    with pytest.raises(UserError, match=r"prompt \d is \d+ tokens: with max_new_tokens 64 it exceeds the network"):
        complete(exported, plan, prompts, max_new_tokens=64)


# ------------------------------------------------------------------ command line
def test_jsonl_output_round_trips(exports, diffusion, tmp_path, capsys):
    out = tmp_path / "samples.jsonl"
    run_dir = exports["diffusion"].parent  # a run directory: RUN/export is used
    assert unmask_in_process(["sample", str(run_dir), "--num", "3", "--sampler", "remdm", "--steps", "10",
                              "--sampler-option", "schedule=loop", "--sampler-option", "eta=0.05", "--seq-len",
                              str(SEQ_LEN), "--prompt", PROMPT, "--seed", "2", "--batch-size", "2", "--temperature",
                              "0.9", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    plan = SamplingPlan(sampler="remdm", steps=10, seed=2, temperature=0.9,
                        options=RemaskOptions(schedule="loop", eta=0.05))
    expected = generate(diffusion, plan, num=3, seq_len=SEQ_LEN, prompt=PROMPT)
    quality = {"unigram_entropy", "reference_nll", "reference_tokens"}
    assert [{k: v for k, v in record.items() if k not in quality} for record in records] == \
        [sample.to_dict() for sample in expected]
    assert set(records[0]) == {"text", "tokens", "text_tokens", "network_calls", "prompt", "index", "plan"} | quality
    assert SamplingPlan.from_dict(records[0]["plan"]) == plan
    printed = capsys.readouterr().out
    assert "wrote 3 samples" in printed and "mean unigram entropy:" in printed


def test_text_output_has_one_block_per_sample(exports, diffusion, capsys):
    assert unmask_in_process(["sample", str(exports["diffusion"]), "--num", "2", "--steps", "6", "--seq-len",
                              "12", "--prompt", PROMPT]) == 0
    printed = capsys.readouterr().out
    expected = generate(diffusion, SamplingPlan(steps=6), num=2, seq_len=12, prompt=PROMPT)
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
    ({"num": 0}, r"--num must be an integer >= 1"),
    ({"batch_size": 0}, r"--batch-size"),
    ({"seq_len": 0}, r"--seq-len must be an integer >= 1"),
    ({"seq_len": MAX_SEQ_LEN + 1}, r"--seq-len 65 exceeds the network's max_seq_len 64: add --block-len"),
    ({"seq_len": 100, "plan": SamplingPlan(steps=4, block_len=65)}, r"--block-len 65 exceeds the network's"),
    ({"device": "nonsense"}, r"--device"),
])
def test_bad_arguments_name_the_flag(diffusion, arguments, message):
    call = {"num": 1, "seq_len": SEQ_LEN, **arguments}
    plan = call.pop("plan", SamplingPlan(steps=4))
    with pytest.raises(UserError, match=message):
        generate(diffusion, plan, **call)


@pytest.mark.parametrize("sampler", ["first-hitting", "confidence", "remdm"])
def test_a_sampler_the_process_does_not_take_is_refused_before_sampling(exports, sampler):
    uniform = load_export(exports["uniform"])
    with pytest.raises(UserError, match=rf"--sampler {sampler}: the {sampler} sampler does not apply to the "
                                        rf"uniform process: .* \(its samplers: ancestral\)"):
        generate(uniform, SamplingPlan(sampler=sampler, steps=4), num=1, seq_len=SEQ_LEN)
    sample = generate(uniform, SamplingPlan(steps=4), num=1, seq_len=SEQ_LEN, prompt=PROMPT)[0]
    assert sample.text.startswith(PROMPT) and max(sample.tokens) < VOCAB_SIZE


@pytest.mark.parametrize("argv, message", [
    (["--sampler", "remdm", "--steps", "0"], "--steps: steps must be an integer >= 1"),
    (["--top-p", "1.5"], r"--top-p: top_p must lie in \(0, 1\]"),
    (["--temperature", "0"], "--temperature: temperature must be a number > 0"),
    (["--block-len", "0"], "--block-len: block_len must be an integer >= 1"),
    (["--sampler", "remdm", "--sampler-option", "eta=2"], r"--sampler-option: remask eta must lie in \[0, 1\]"),
    (["--sampler", "remdm", "--sampler-option", "speed=2"], "--sampler-option: sampler option 'speed=2'"),
    (["--sampler-option", "eta=0.1"], "--sampler-option: the ancestral sampler takes no options"),
])
def test_bad_sampling_flags_are_one_line_naming_the_flag(exports, capsys, argv, message):
    assert unmask_in_process(["sample", str(exports["diffusion"]), "--num", "1", *argv]) != 0
    err = capsys.readouterr().err
    assert re.search(message, err) and len(err.strip().splitlines()) == 1, err


def test_a_template_without_room_to_generate_is_refused(diffusion):
    text = "the cat sat on the mat"
    length = len(diffusion.tokenizer.encode(text))
    with pytest.raises(UserError, match=rf"--infill fills all {length} positions .* nothing is left"):
        build_prompt(diffusion.tokenizer, length, VOCAB_SIZE, infill=text)


# ------------------------------------------------------------------ autoregressive exports
def test_autoregressive_sampling_keeps_the_prefix_and_is_deterministic(autoregressive):
    prefix = autoregressive.tokenizer.encode(PROMPT)
    plan = SamplingPlan(top_p=0.95, temperature=0.9, seed=4)
    samples = generate(autoregressive, plan, num=3, seq_len=SEQ_LEN, prompt=PROMPT, batch_size=2)
    assert samples == generate(autoregressive, plan, num=3, seq_len=SEQ_LEN, prompt=PROMPT, batch_size=3)
    assert [s.tokens for s in samples] != [s.tokens for s in generate(
        autoregressive, replace(plan, seed=5), num=3, seq_len=SEQ_LEN, prompt=PROMPT, batch_size=2)]
    for sample in samples:
        assert sample.tokens[:len(prefix)] == prefix and sample.text.startswith(PROMPT)
        assert sample.network_calls == SEQ_LEN - len(prefix)


def test_autoregressive_tokens_follow_the_network_left_to_right(autoregressive):
    """With a tiny nucleus the draw is greedy: each token is the argmax given the ones before."""
    samples = generate(autoregressive, SamplingPlan(top_p=1e-9), num=2, seq_len=SEQ_LEN)
    tokens = torch.tensor([s.tokens for s in samples])
    start = torch.full((2, 1), VOCAB_SIZE)
    with torch.no_grad():
        logits = autoregressive.network(torch.cat([start, tokens[:, :-1]], dim=1))
    assert torch.equal(logits.argmax(-1), tokens)



def test_autoregressive_sampling_reads_one_new_row_per_call_after_its_kv_cache(autoregressive):
    """The first call reads the start token and the prompt, each later one only the newest token."""
    prefix = autoregressive.tokenizer.encode(PROMPT)
    shapes = []
    hook = autoregressive.network.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    try:
        generate(autoregressive, SamplingPlan(seed=1), num=2, seq_len=SEQ_LEN, prompt=PROMPT, batch_size=2)
    finally:
        hook.remove()
    assert shapes == [(2, 1 + len(prefix))] + [(2, 1)] * (SEQ_LEN - len(prefix) - 1)


def test_a_causal_network_that_masks_documents_reads_its_whole_context_at_every_call():
    """Its attention mask is built from the tokens it is given, so it runs without the cache:
    greedy tokens are the full forward's argmax, across a document boundary (token 0)."""
    torch.manual_seed(0)
    network = Transformer(TransformerConfig(vocab_size=16, n_layers=1, d_model=16, n_heads=2, max_seq_len=12,
                                            causal=True, document_separator=0)).eval()
    prefix = torch.tensor([[3, 5, 0, 7]])   # a document ends after 5
    with torch.no_grad():
        tokens = generation.autoregressive_sample(network, 16, prefix, 12, SamplingPlan(top_p=1e-9),
                                                  sample_generators(0, [0]))
        logits = network(torch.cat([torch.full((1, 1), 16), tokens[:, :-1]], dim=1))
    assert torch.equal(logits.argmax(-1)[:, 4:], tokens[:, 4:])


@pytest.mark.parametrize("plan, infill, message", [
    (SamplingPlan(), TEMPLATE, r"--infill needs a diffusion export"),
    (SamplingPlan(sampler="first-hitting"), None, r"--sampler first-hitting needs a diffusion export"),
    (SamplingPlan(block_len=8), None, r"--block-len needs a diffusion export"),
    (SamplingPlan(compile="on"), None, r"--compile on: an autoregressive model samples one new token per call"),
])
def test_autoregressive_exports_refuse_what_only_diffusion_does(autoregressive, plan, infill, message):
    with pytest.raises(UserError, match=message):
        generate(autoregressive, plan, num=1, seq_len=SEQ_LEN, infill=infill)


# ------------------------------------------------------------------ compile
@pytest.mark.parametrize("plan,tokens", [
    (SamplingPlan(steps=1000), 3 * 1024 * 1000),                               # the budget per row
    (SamplingPlan(sampler="first-hitting"), 3 * 1024 * 1024),                  # one call per token
    (SamplingPlan(steps=100, block_len=256), 3 * 1024 * 100 * 4),              # the budget per block
])
def test_the_work_that_decides_compiling_bounds_the_tokens_through_the_network(plan, tokens):
    batch = generation._Batch([0, 1, 2], torch.zeros(3, 1024, dtype=torch.long), [None] * 3, 1024)
    assert generation._network_tokens(plan, [batch]) == tokens


def test_compiled_sampling_draws_the_eager_samples_from_three_graphs_without_a_break(exports, diffusion):
    """The blocks compiled as ``compile_parts`` does for sampling on a GPU (here with a counting
    CPU backend): the calls, with every row count of the batch at every step of the sampler,
    reuse at most three graphs (the first shape, the batch dimension dynamic, and one row,
    which torch specializes); no graph break."""
    plan = SamplingPlan(steps=12, seed=5)
    eager = generate(diffusion, plan, num=5, seq_len=SEQ_LEN, batch_size=4)
    compiled = load_export(exports["diffusion"])
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled.network.compile_parts(backend=counter)  # generate's own compile_parts then does nothing
    again = generate(compiled, replace(plan, compile="on"), num=5, seq_len=SEQ_LEN, batch_size=4)
    assert [sample.tokens for sample in again] == [sample.tokens for sample in eager]
    assert len({sample.network_calls for sample in eager}) > 1  # rows needed different calls
    assert sum(sample.network_calls for sample in eager) > 20 and counter.frame_count <= 3
    assert not torch._dynamo.utils.counters["graph_break"]


# ------------------------------------------------------------------ block diffusion
def test_unmask_sample_generates_past_the_context_and_stops_at_eos(block_export, tmp_path):
    import json

    from tests.support.cli_runner import unmask_in_process

    out = tmp_path / "samples.jsonl"
    assert unmask_in_process(["sample", str(block_export), "--num", "3", "--sampler", "first-hitting",
                              "--seq-len", "150", "--until-eos", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(record["tokens"]) for record in records] == [150] * 3  # past max_seq_len 64
    assert all(record["plan"]["until_eos"] is not None for record in records)
    # a block export samples in its own blocks: another --block-len is refused in one line
    assert unmask_in_process(["sample", str(block_export), "--num", "1", "--block-len", "4"]) == 2


def test_a_long_block_sample_shows_its_progress_block_by_block(block_export, capsys):
    """A block export samples any length: one sample of a million tokens runs for minutes, so the
    bar counts blocks (8 tokens each here), not batches, and reaches its total at an early EOS too."""
    exported = load_export(block_export)
    for plan in (SamplingPlan(sampler="first-hitting"), SamplingPlan(steps=2, until_eos=exported.tokenizer.eos_id)):
        generate(exported, plan, num=2, seq_len=100, batch_size=1)  # 13 blocks per sample, the last one partial
        err = capsys.readouterr().err
        assert re.search(r"sample: +100%.* 26/26 \[.*block/s\]", err), err


def test_compile_on_is_refused_for_a_block_export_which_samples_uncompiled(block_export, capsys):
    err = one_line_error(capsys, "sample", str(block_export), "--num", "1", "--steps", "2", "--compile", "on")
    assert ("--compile on: a block diffusion model is sampled and scored uncompiled (its sampler runs the KV cache "
            "between the network's calls") in err and err.strip().endswith("leave --compile auto or off")
    generate(load_export(block_export), SamplingPlan(steps=2, compile="off"), num=1, seq_len=16)


def test_until_eos_on_an_autoregressive_export_is_refused_with_the_true_reason(autoregressive, exports, capsys):
    with pytest.raises(UserError, match=r"--until-eos needs a block diffusion export \(model.block_size\), which "
                                        r"samples block by block until the EOS, any length: an autoregressive model "
                                        r"samples at most its max_seq_len tokens, and its text already ends at the "
                                        r"first EOS; leave --until-eos out"):
        generation.until_eos_plan(autoregressive, SamplingPlan())
    err = one_line_error(capsys, "sample", str(exports["diffusion"]), "--num", "1", "--steps", "2", "--until-eos")
    assert "this model samples the whole sequence at once" in err


def test_complete_continues_prompts_of_any_length_with_the_block_sampler(block_export):
    from evaluation.generation.generate import complete
    from pipeline.interchange.export import load_export

    exported = load_export(block_export)
    plan = SamplingPlan(sampler="ancestral", steps=4)
    prompts = ["ROMEO:", "First Citizen: we are"]
    samples = complete(exported, plan, prompts, max_new_tokens=70)  # past max_seq_len 64, not whole blocks
    for prompt, sample in zip(prompts, samples):
        encoded = exported.tokenizer.encode(prompt)
        assert len(sample.tokens) == len(encoded) + 70 and sample.tokens[:len(encoded)] == encoded


# ------------------------------------------------------------------ on a device
GENERATION_CASES = [("masked", SamplingPlan(steps=8)), ("masked", SamplingPlan(sampler="first-hitting")),
                    ("masked", SamplingPlan(sampler="confidence", steps=4)), ("masked", SamplingPlan(sampler="remdm",
                                                                                                   steps=8)),
                    ("masked", SamplingPlan(steps=4, block_len=8)), ("uniform", SamplingPlan(steps=4)),
                    ("learned", SamplingPlan(steps=4)), ("ar", SamplingPlan()),
                    ("block", SamplingPlan(steps=4)), ("block", SamplingPlan(sampler="first-hitting")),
                    ("block", SamplingPlan(sampler="confidence", steps=4)), ("block", SamplingPlan(sampler="remdm",
                                                                                                 steps=8))]


@pytest.mark.parametrize(("name", "plan"), GENERATION_CASES)
def test_unmask_sample_runs_on_the_device_and_draws_the_samples_of_the_host(exports_of_every_kind, name, plan):
    exported = exports_of_every_kind[name]
    options = dict(num=3, seq_len=EXPORT_LENGTH + 8 if plan.block_len else 16, prompt="the cat", batch_size=2)
    on_host = generate(exported, plan, device="cpu", **options)
    with on_fake_device():
        try:
            on_device = generate(exported, plan, device=DEVICE.type, **options)
        finally:
            exported.network.to("cpu")   # the export is shared by the module's tests
    assert [s.tokens for s in on_device] == [s.tokens for s in on_host]
    assert [s.network_calls for s in on_device] == [s.network_calls for s in on_host]
