"""The ``unmask`` model of lm-evaluation-harness (``evaluation.downstream.lm_eval_model``), request
by request and through lm-eval's own command line: untrained exports of every process answer
the three request types; generation keeps the prompt, stops at the stop sequence, and takes the
samplers its process takes. Nothing downloads (the harness runs offline)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from lm_eval.api.instance import Instance

from common.errors import UserError
from evaluation.downstream.lm_eval_model import UnmaskLM, sample_continuation
from evaluation.downstream.lm_eval_model import main as lm_eval_main
from evaluation.downstream.tasks import TASKS_DIR
from tests.support.paths import PTB, SHARED, needs_shared

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread", "no_environment_report"),
              needs_shared("lambada/lambada_test.jsonl", "ptb/ptb.test.txt")]


def test_lm_eval_s_own_command_line_scores_the_unmask_model(exports, tmp_path):
    code = lm_eval_main(["--model", "unmask", "--model_args", f"path={exports['ar']}", "--tasks", "ptb_word_order",
                         "--include_path", str(TASKS_DIR), "--metadata", json.dumps({"data_dir": str(SHARED)}),
                         "--limit", "2", "--batch_size", "auto", "--device", "cpu", "--output_path", str(tmp_path)])
    assert code == 0
    written = list(tmp_path.rglob("results_*.json"))
    assert len(written) == 1 and "acc,none" in json.loads(written[0].read_text())["results"]["ptb_word_order"]


# ---------------------------------------------------------------- the model, request by request
def _requests(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=args, idx=0, metadata=("task", index, 1))
            for index, args in enumerate(arguments)]


@pytest.mark.parametrize("process", ["absorbing", "uniform", "learned"])
def test_every_process_answers_the_three_request_types(exports, process):
    model = UnmaskLM(path=exports[process], samples=4, device="cpu")
    text = [line.strip() for line in PTB.read_text(encoding="utf-8").splitlines()[:10]]
    pairs = [(context, " " + word) for context, word in (line.rsplit(" ", 1) for line in text[:6])] + [("", " the")]
    scores = model.loglikelihood(_requests("loglikelihood", pairs))
    rolling = model.loglikelihood_rolling(_requests("loglikelihood_rolling", [(" ".join(text),)]))
    generated = model.generate_until(_requests("generate_until", [
        ("the company", {"until": ["."], "max_gen_toks": 5, "do_sample": False})]))
    assert all(ll < 0 and isinstance(greedy, bool) for ll, greedy in scores)
    assert all(record.score.standard_error > 0 for record in model.records)
    assert rolling[0] < 0 and len(model.records) == len(pairs) + 1
    assert "." not in generated[0]
    prompt = model.tok_encode("the company")
    plan = model.generation.plan(5, top_p=None, temperature=1.0, seed=0)
    drawn = sample_continuation(model.exported, model.model, prompt, 5, plan=plan, index=3)
    assert len(drawn) == 5 and all(0 <= token < model.exported.tokenizer.vocab_size for token in drawn)
    assert drawn == sample_continuation(model.exported, model.model, prompt, 5, plan=plan, index=3)  # its own seed


def test_generation_keeps_the_prompt_stops_at_the_stop_sequence_and_is_greedy(exports):
    model = UnmaskLM(path=exports["ar"], device="cpu")
    tokenizer, network, prompt = model.exported.tokenizer, model.exported.network, "the company said"
    tokens = tokenizer.encode(prompt)
    kept = len(tokens)
    for _ in range(8):   # greedy decoding by hand, after the prompt
        with torch.no_grad():
            tokens.append(int(network(torch.tensor([[network.config.vocab_size, *tokens]]), None)[0, -1].argmax()))
    new = tokens[kept:]
    expected = tokenizer.decode(new[:new.index(tokenizer.eos_id)] if tokenizer.eos_id in new else new)
    stop = expected.strip()[-1]      # a character the greedy text reaches: the answer ends before it
    answer, = model.generate_until(_requests("generate_until", [(prompt, {"until": [stop], "max_gen_toks": 8})]))
    assert answer == expected.split(stop)[0]
    long_prompt = " ".join(["word"] * 400)   # far beyond max_seq_len: cut from the left, still answered
    assert isinstance(model.generate_until(_requests("generate_until", [(long_prompt, {"max_gen_toks": 4})]))[0], str)


def test_generation_takes_any_sampler_its_process_takes_and_refuses_the_others_in_one_line(exports):
    """``gen_sampler`` is the SamplingPlan's sampler: first-hitting answers on the absorbing
    process; the uniform process and an autoregressive export refuse it, an unknown name too."""
    model = UnmaskLM(path=exports["absorbing"], device="cpu", gen_sampler="first-hitting")
    answer, = model.generate_until(_requests("generate_until", [("the company", {"max_gen_toks": 4,
                                                                                 "do_sample": True})]))
    assert isinstance(answer, str)
    for process, sampler, message in (
            ("uniform", "first-hitting", "model argument gen_sampler=first-hitting: the first-hitting sampler does "
                                         "not apply to the uniform process"),
            ("ar", "confidence", "model argument gen_sampler=confidence: an autoregressive export samples left"),
            ("absorbing", "gibbs", "model argument gen_sampler: sampler must be one of ancestral, first-hitting")):
        with pytest.raises(UserError, match=message):
            UnmaskLM(path=exports[process], device="cpu", gen_sampler=sampler)


def test_an_export_whose_block_size_was_edited_is_refused_naming_config_json_and_the_field(exports, tmp_path):
    """A block size of 256 in a window of 128 would leave rows of 0 tokens (128 // 256 blocks):
    refused at load, naming the field, never as "max_seq_len 0"."""
    export = tmp_path / "export"
    shutil.copytree(exports["absorbing"], export)
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "block_size": 256}))
    with pytest.raises(UserError, match=rf"^{export / 'config.json'}: block_size 256 does not divide "
                                        r"network.max_seq_len 128") as caught:
        UnmaskLM(path=export, device="cpu")
    assert "max_seq_len 0" not in str(caught.value)


def test_generation_takes_guidance_as_a_model_argument(exports):
    """``gen_guidance`` guides generate_until towards the context: weight 0 answers as no guidance
    does; an autoregressive export and a value that is not a number are refused in one line."""
    request = [("the company", {"max_gen_toks": 4, "do_sample": True})]
    plain, = UnmaskLM(path=exports["absorbing"], device="cpu").generate_until(_requests("generate_until", request))
    model = UnmaskLM(path=exports["absorbing"], device="cpu", gen_guidance="0")
    assert model.generation.guidance == 0.0
    assert model.generate_until(_requests("generate_until", request)) == [plain]
    with pytest.raises(UserError, match="model argument gen_guidance: guidance masks the context"):
        UnmaskLM(path=exports["ar"], device="cpu", gen_guidance=1.0)
    with pytest.raises(UserError, match="model argument gen_guidance must be a number >= 0, got 'strong'"):
        UnmaskLM(path=exports["absorbing"], device="cpu", gen_guidance="strong")
    with pytest.raises(UserError, match="model argument gen_guidance: guidance must be a number >= 0"):
        UnmaskLM(path=exports["absorbing"], device="cpu", gen_guidance=-1)


def test_loglikelihood_takes_guidance_as_a_model_argument(exports):
    """``guidance`` scores loglikelihood requests by guided logits: weight 0 scores as no guidance does;
    the records and lm-eval's model information say a guided score is no likelihood bound; exports
    it cannot guide and a value that is not a number are refused in one line."""
    requests = _requests("loglikelihood", [("the company", " said"), ("the company", " the"), ("a", " new")])
    plain = UnmaskLM(path=exports["absorbing"], samples=4, device="cpu").loglikelihood(requests)
    model = UnmaskLM(path=exports["absorbing"], samples=4, device="cpu", guidance="0")
    assert model.guidance == 0.0 and model.loglikelihood(requests) == plain
    assert {record.kind for record in model.records} == {"loglikelihood (guided)"}
    assert "not a likelihood bound" in model.get_model_info()["unmask_loglikelihood"]
    guided = UnmaskLM(path=exports["absorbing"], samples=4, device="cpu", guidance=2.0).loglikelihood(requests)
    assert [score for score, _ in guided] != [score for score, _ in plain]
    for name in ("ar", "uniform"):
        with pytest.raises(UserError, match="^model argument guidance: guidance masks the context in a second pass"):
            UnmaskLM(path=exports[name], device="cpu", guidance=1.0)
    with pytest.raises(UserError, match="^model argument guidance must be a number >= 0, got 'strong'"):
        UnmaskLM(path=exports["absorbing"], device="cpu", guidance="strong")


def test_generation_takes_whole_sequence_blocks_and_the_dual_cache_as_model_arguments(exports):
    """``gen_block_len``, ``gen_whole_sequence`` (lm-eval passes "true") and ``gen_dual_cache``: the
    dual cache refreshed at every call answers as no cache does; what cannot apply is refused in one line."""
    request = _requests("generate_until", [("the company", {"max_gen_toks": 12, "do_sample": True})])
    blocks = {"gen_block_len": 4, "gen_whole_sequence": "true", "gen_sampler": "confidence", "gen_steps": 2}
    whole = UnmaskLM(path=exports["absorbing"], device="cpu", **blocks)
    assert whole.generation.whole_sequence is True and whole.generation.plan(12, top_p=None, temperature=1.0,
                                                                           seed=0).block_len == 4
    plain = whole.generate_until(request)
    assert UnmaskLM(path=exports["absorbing"], device="cpu", gen_dual_cache="1", **blocks).generate_until(request) \
        == plain
    assert UnmaskLM(path=exports["absorbing"], device="cpu", gen_dual_cache=3, **blocks).generation.dual_cache == 3
    for arguments, message in (({"gen_whole_sequence": "yes"}, "gen_whole_sequence must be true or false"),
                               ({"gen_whole_sequence": True}, "gen_whole_sequence: whole_sequence shows"),
                               ({"gen_dual_cache": 2, "gen_block_len": 4}, "gen_dual_cache: dual_cache caches"),
                               ({"gen_block_len": 0}, "gen_block_len=0: must be an integer >= 1")):
        with pytest.raises(UserError, match=f"^model argument {message}"):
            UnmaskLM(path=exports["absorbing"], device="cpu", **arguments)
    with pytest.raises(UserError, match="^model argument gen_whole_sequence: the network sees the suffix masked"):
        UnmaskLM(path=exports["uniform"], device="cpu", gen_block_len=4, gen_whole_sequence=True)
