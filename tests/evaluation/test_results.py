"""The results files (``evaluation.results``), written and read from their records
(``evaluation.records``): the bytes of results.json and downstream.json that unmask writes are
those of the fixtures (written before the records were read from their dataclasses' fields),
every fixture reads back as the record it was written from, and a malformed file names every
key it lacks."""

import copy
import json
import math
import re
from pathlib import Path

import pytest

from evaluation.results import (
    ABSENT,
    Comparison,
    DatasetResult,
    DownstreamResults,
    EvalResults,
    GenerativePerplexity,
    MlflowRecord,
    ModelRecord,
    PerTimeContributions,
    ProtocolRecord,
    SampleRecord,
    SamplingRecord,
    ScheduleRecord,
    ScheduleToken,
    SweepRow,
    TaskResult,
    TokenizerRecord,
    TrainingRecord,
)
from model.sampling import SamplingPlan
from tests.support.results_fixtures import make_downstream

FIXTURES = Path(__file__).parent / "fixtures"
SHA = "0f" * 32


def _model(objective: str = "diffusion", *, note: bool = True) -> ModelRecord:
    return ModelRecord(path="/runs/ünïcode run/export", objective=objective, step=12_000 if note else None,
                       tokens_seen=6_291_456_000 if note else None, weights="ema" if note else None,
                       weights_note="EMA weights (decay 0.9999)" if note else ABSENT,
                       network={"n_layers": 2, "d_model": 64, "rope": {"base": 10000.0, "scaling": None},
                                "dims": [1, 2, 3], "tied": True},
                       tokenizer=TokenizerRecord(kind="gpt2-bpe", sha256=SHA, vocab_size=50258))


def _dataset(name: str, nelbo: float, *, per_t: bool) -> DatasetResult:
    se = nelbo / 300
    return DatasetResult(
        dataset={"name": name, "split": "test", "path": f"/data/{name}/test.txt", "sha256": SHA,
                 "detokenizer": name, "documents": 100, "utf8_bytes": 123_456, "protocol": "mdlm",
                 "dropped_tokens": 7},
        estimate={"nelbo_per_token": nelbo, "standard_error": se, "num_tokens": 4096, "kind": "continuous",
                  "discrete_steps": None,
                  "perplexity_interval_95": [math.exp(nelbo - 2 * se), math.exp(nelbo + 2 * se)],
                  "tiny": 1e-05, "degrees_of_freedom": 15},
        nelbo_per_token=nelbo, standard_error=se, perplexity_bound=math.exp(nelbo),
        perplexity_interval=(math.exp(nelbo - 2 * se), math.exp(nelbo + 2 * se)),
        bits_per_byte=nelbo * 4096 / (math.log(2) * 123_456), num_tokens=4096,
        per_t=PerTimeContributions(t=[0.125, 0.5, 0.875], contribution=[1.5, 3.25, 6.0]) if per_t else ABSENT)


def rich_results() -> EvalResults:
    """Every key results.json can hold, with nested records, lists, nulls and non-ASCII text."""
    plan = SamplingPlan(sampler="remdm", steps=64, grid="cosine", top_p=0.9, temperature=0.8, seed=3, block_len=16,
                        until_eos=50256)
    return EvalResults(
        model=_model(),
        protocol=ProtocolRecord(name="mdlm", seq_len=1024, samples_per_block=16, seed=0, estimator="continuous",
                          discrete_steps=None, target_rel_error=0.002, add_eos=True, split="valid",
                          max_documents=100, blocks_per_replicate=4, wrapping="framed | BOS ... EOS",
                          bound="block diffusion (blocks of 16 tokens)", block_size=16,
                          precision="bf16 autocast on GPU", world_size=2),
        datasets={"wikitext2": _dataset("wikitext2", 3.25, per_t=True),
                  "notes/my file.txt": _dataset("notes/my file.txt", 4.5, per_t=False)},
        samples=(SampleRecord(text='Le "café" <b>\n\nsecond ¶ — ✓', network_calls=64, unigram_entropy=4.25,
                              reference_nll=300.5, reference_tokens=100),
                 SampleRecord(text="", network_calls=0)),
        mlflow=MlflowRecord(tracking_uri="http://127.0.0.1:5000", run_id="0123abcd"),
        created="2025-01-02T03:04:05+00:00", unmask_version="0.1.0", git_commit="deadbeef",
        training=TrainingRecord(untrained_val_nelbo_per_token=10.8, final_step=12_000,
                                final_val_nelbo_per_token=3.9, val_split="val"),
        comparison=Comparison(model=_model("autoregressive", note=False),
                              datasets={"wikitext2": _dataset("wikitext2", 3.0, per_t=False)},
                              path="/runs/ar/report/results.json"),
        sampling=SamplingRecord(num_samples=2, plan=plan, seq_len=128, mean_unigram_entropy=4.0,
                                mean_network_calls=32.0,
                                generative_perplexity=GenerativePerplexity(
                                    reference="/models/gpt2-large", reference_kind="huggingface", retokenized=True,
                                    perplexity=20.09, tokens=100),
                                sweep=(SweepRow(sampler="ancestral", budget=16, network_calls=16.0,
                                                mean_unigram_entropy=4.1, generative_perplexity=40.5),
                                       SweepRow(sampler="first-hitting", budget=1024, network_calls=128.0,
                                                mean_unigram_entropy=4.2, generative_perplexity=None))),
        schedule=ScheduleRecord(exponent_min=0.61, exponent_median=1.2, exponent_max=3.5,
                                unmask_first=(ScheduleToken(token=50256, text="<|endoftext|>", exponent=3.5),
                                              ScheduleToken(token=198, text="\n", exponent=3.1)),
                                unmask_last=(ScheduleToken(token=34501, text=" diligently", exponent=0.61),)))


def bare_results() -> EvalResults:
    """The fewest keys: no optional record, MLflow down, no validation at step 0, no samples."""
    return EvalResults(
        model=_model("autoregressive", note=False),
        protocol=ProtocolRecord(name="unmask", seq_len=512, samples_per_block=1, seed=7, estimator="autoregressive",
                          discrete_steps=None, target_rel_error=None, add_eos=False, split="test", max_documents=None,
                          wrapping="documents + EOS concatenated | cut into blocks", bound="autoregressive",
                          precision="float32 on CPU", world_size=1),
        datasets={"val": _dataset("val", 5.0, per_t=False)}, samples=(), mlflow=None,
        created="2025-01-02T03:04:05+00:00", unmask_version="0.1.0", git_commit="unknown", training=None)


def rich_downstream(mlflow: bool = True) -> DownstreamResults:
    return DownstreamResults(
        model=_model(),
        tasks={"lambada_openai": TaskResult(metrics={"acc,none": 0.3125, "acc_stderr,none": 0.0064,
                                                     "perplexity,none": 41.5, "alias": "lambada_openai"},
                                            higher_is_better={"acc": True, "perplexity": False}, documents=500,
                                            documents_total=5153, requests=500, mean_log_likelihood=-3.7257,
                                            monte_carlo_error=0.0421, median_request_error=1.93, truncated_contexts=3),
               "gsm8k": TaskResult(metrics={"exact_match,strict-match": 0.02, "bits_per_byte_stderr,none": "N/A"},
                                   higher_is_better={"exact_match": True}, documents=10, documents_total=10)},
        settings={"tasks": ["lambada_openai", "gsm8k"], "samples": 16, "seed": 0, "limit": 500, "num_fewshot": None,
                  "device": "cpu"},
        lm_eval_version="0.4.13", lm_eval_results="lm_eval_results.json",
        mlflow=MlflowRecord(tracking_uri="file:///tmp/ml runs", run_id="abc") if mlflow else None,
        created="2025-01-02T03:04:05+00:00", unmask_version="0.1.0", git_commit="deadbeef")


CASES = {"results_rich.json": rich_results, "results_bare.json": bare_results}
DOWNSTREAM_CASES = {"downstream_rich.json": rich_downstream,
                    "downstream_no_mlflow.json": lambda: rich_downstream(False)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_results_json_keeps_its_bytes_and_reads_back(name):
    written = (FIXTURES / name).read_text(encoding="utf-8")
    results = CASES[name]()
    assert results.dumps() == written
    read = EvalResults.read(FIXTURES / name)
    assert read == results
    assert read.dumps() == written


@pytest.mark.parametrize("name", sorted(DOWNSTREAM_CASES))
def test_downstream_json_keeps_its_bytes_and_reads_back(name):
    written = (FIXTURES / name).read_text(encoding="utf-8")
    results = DOWNSTREAM_CASES[name]()
    assert results.dumps() == written
    read = DownstreamResults.read(FIXTURES / name)
    assert read == results
    assert read.dumps() == written


def test_the_report_tables_list_the_fields_in_their_order():
    # The report's "Evaluation" and "Model" tables list the fields as the records' JSON objects hold them.
    results = rich_results()
    assert list(results.protocol.to_json()) == [
        "name", "seq_len", "samples_per_block", "seed", "estimator", "discrete_steps", "target_rel_error", "add_eos",
        "split", "max_documents", "blocks_per_replicate", "wrapping", "bound", "block_size", "precision",
        "world_size"]
    assert list(results.model.to_json()) == ["path", "objective", "step", "tokens_seen", "weights", "weights_note",
                                             "network", "tokenizer"]


def _without(data: dict, *paths: str) -> dict:
    """``data`` without the keys at the dotted ``paths`` (list entries by index)."""
    data = copy.deepcopy(data)
    for path in paths:
        *parents, last = path.split(".")
        inner = data
        for key in parents:
            inner = inner[int(key)] if isinstance(inner, list) else inner[key]
        del inner[last]
    return data


RESULTS_LACKING = [
    (("datasets.wikitext2.bits_per_byte",), "datasets.wikitext2.bits_per_byte"),
    (("schedule.unmask_last.0.exponent",), "schedule.unmask_last.0.exponent"),
    (("created", "model.tokenizer.sha256", "protocol.seed"), "created, model.tokenizer.sha256, protocol.seed"),
    (("comparison.model.path", "comparison.datasets.wikitext2.num_tokens"),
     "comparison.model.path, comparison.datasets.wikitext2.num_tokens"),
    (("sampling.generative_perplexity.tokens", "sampling.sweep.1.budget", "sampling.seq_len"),
     "sampling.seq_len, sampling.generative_perplexity.tokens, sampling.sweep.1.budget"),
    (("samples.1.text", "training.final_step", "mlflow.run_id"), "samples.1.text, mlflow.run_id, training.final_step"),
    (("datasets.wikitext2.per_t.t",), "datasets.wikitext2.per_t.t"),
]


@pytest.mark.parametrize("paths, named", RESULTS_LACKING)
def test_a_malformed_results_json_names_every_key_it_lacks_in_one_line(paths, named):
    data = _without(json.loads(rich_results().dumps()), *paths)
    message = (f"results lack {named} (see evaluation.results for the schema); rerun `unmask eval` to write them "
               f"anew")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        EvalResults.from_json(data)


def test_what_is_no_json_object_is_named_whole():
    data = json.loads(rich_results().dumps())
    with pytest.raises(ValueError, match=r"^results lack results \(see"):
        EvalResults.from_json([])
    with pytest.raises(ValueError, match=r"^results lack model, datasets, samples.0 \(see"):
        EvalResults.from_json({**data, "model": "x", "datasets": [], "samples": [None]})
    with pytest.raises(ValueError, match=r"^results lack datasets.wikitext2.perplexity_interval \(see"):
        EvalResults.from_json(_with(data, "wikitext2", perplexity_interval=[1.0]))


def _with(data: dict, dataset: str, **values) -> dict:
    data = copy.deepcopy(data)
    data["datasets"][dataset].update(values)
    return data


@pytest.mark.parametrize("paths, named", [
    (("tasks.gsm8k.documents", "lm_eval_version"), "lm_eval_version, tasks.gsm8k.documents"),
    (("model.tokenizer.kind", "settings"), "settings, model.tokenizer.kind")])
def test_a_malformed_downstream_json_names_every_key_it_lacks_in_one_line(paths, named):
    data = _without(json.loads(rich_downstream().dumps()), *paths)
    message = (f"downstream results lack {named} (see evaluation.results for the schema); rerun `unmask lm-eval` "
               f"to write them anew")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        DownstreamResults.from_json(data)


def write_fixtures() -> None:
    """Write the fixtures anew (only when their format changes on purpose)."""
    for name, build in {**CASES, **DOWNSTREAM_CASES}.items():
        (FIXTURES / name).write_text(build().dumps(), encoding="utf-8")


if __name__ == "__main__":
    write_fixtures()


# ---------------------------------------------------------------- downstream.json by hand
def test_the_record_reads_back_what_it_writes_and_names_what_it_lacks():
    data = make_downstream()
    record = DownstreamResults.from_json(copy.deepcopy(data))
    assert json.loads(record.dumps()) == data
    assert record.tasks["lambada_openai"].values() == {"acc,none": (0.3125, 0.0064), "perplexity,none": (41.5, 1.2)}
    assert record.tasks["gsm8k"].values()["bits_per_byte,none"] == (1.1, None)
    del data["tasks"]["gsm8k"]["documents"], data["lm_eval_version"]
    with pytest.raises(ValueError, match="lm_eval_version, tasks.gsm8k.documents"):
        DownstreamResults.from_json(data)
