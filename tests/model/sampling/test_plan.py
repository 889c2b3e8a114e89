"""``SamplingPlan``: valid by construction (a bad field is named), recorded and read back as
one JSON object, sampler options from a command line's KEY=VALUE; which process takes which
sampler."""

import json

import pytest
import torch

from model import AbsorbingDiffusion, LearnedDiffusion, LearnedSchedule, UniformDiffusion, make_schedule
from model.sampling import (
    ConfidenceOptions,
    PlanError,
    RemaskOptions,
    SamplingPlan,
    parse_sampler_options,
)


def test_defaults_resolve_the_samplers_options():
    assert SamplingPlan().options is None and SamplingPlan().steps == 1000
    assert SamplingPlan(sampler="confidence", steps=8).options == ConfidenceOptions()
    remdm = SamplingPlan(sampler="remdm", steps=8)
    assert remdm.options == RemaskOptions(schedule="cap", eta=0.008)
    assert RemaskOptions(schedule="loop").eta == 0.02 and RemaskOptions(schedule="rescale").eta == 0.015
    assert SamplingPlan(sampler="first-hitting").steps is None  # exact: one call per token
    assert SamplingPlan(sampler="remdm").steps == 1000 and SamplingPlan(steps=None).steps == 1000


@pytest.mark.parametrize("fields,field,match", [
    ({"sampler": "gibbs"}, "sampler", "sampler must be one of ancestral, first-hitting, confidence, remdm"),
    ({"steps": 0}, "steps", "steps must be an integer >= 1"),
    ({"steps": 2.5}, "steps", "steps must be an integer >= 1"),
    ({"grid": "log"}, "grid", "grid must be one of uniform, cosine"),
    ({"top_p": 0.0}, "top_p", r"top_p must lie in \(0, 1\]"),
    ({"temperature": 0.0}, "temperature", "temperature must be a number > 0"),
    ({"temperature": float("nan")}, "temperature", "temperature must be a number > 0"),
    ({"seed": -1}, "seed", "seed must be an integer >= 0"),
    ({"block_len": 0}, "block_len", "block_len must be an integer >= 1"),
    ({"compile": "yes"}, "compile", "compile must be one of auto, on, off"),
    ({"options": ConfidenceOptions()}, "options", "the ancestral sampler takes no options"),
    ({"sampler": "remdm", "options": ConfidenceOptions()}, "options", "takes RemaskOptions"),
])
def test_a_bad_field_is_named(fields, field, match):
    with pytest.raises(PlanError, match=match) as caught:
        SamplingPlan(**fields)
    assert caught.value.field == field


@pytest.mark.parametrize("make,field,match", [
    (lambda: RemaskOptions(schedule="sometimes"), "options.schedule", "remask schedule must be one of cap"),
    (lambda: RemaskOptions(eta=1.5), "options.eta", r"remask eta must lie in \[0, 1\]"),
    (lambda: RemaskOptions(t_on=0.01, t_off=0.5), "options.t_on", "0 < t_off < t_on < 1"),
    (lambda: RemaskOptions(alpha_on=1.0), "options.alpha_on", r"alpha_on must lie in \(0, 1\)"),
    (lambda: ConfidenceOptions(score="entropy"), "options.score", "confidence score must be one of max-prob, margin"),
])
def test_a_bad_option_is_named(make, field, match):
    with pytest.raises(PlanError, match=match) as caught:
        make()
    assert caught.value.field == field


@pytest.mark.parametrize("plan", [
    SamplingPlan(),
    SamplingPlan(sampler="first-hitting", steps=None, top_p=0.9, temperature=0.8, seed=3, block_len=64),
    SamplingPlan(sampler="confidence", steps=16, grid="cosine", options=ConfidenceOptions(score="margin")),
    SamplingPlan(sampler="remdm", steps=128, options=RemaskOptions(schedule="loop", eta=0.05), static_shape=True),
    SamplingPlan(steps=64, compile="off"),
])
def test_the_record_is_json_and_reads_back_to_the_same_plan(plan):
    record = json.loads(json.dumps(plan.to_dict()))
    assert SamplingPlan.from_dict(record) == plan
    assert plan.sampler in plan.describe() and f"seed {plan.seed}" in plan.describe()


def test_a_record_with_an_unknown_field_is_refused():
    with pytest.raises(PlanError, match="no field 'temp'"):
        SamplingPlan.from_dict({"sampler": "ancestral", "temp": 1.0})
    with pytest.raises(PlanError, match="has no option 'speed'"):
        SamplingPlan.from_dict({"sampler": "remdm", "steps": 4, "options": {"speed": 2}})


def test_options_from_the_command_line_are_typed():
    assert parse_sampler_options("remdm", ["schedule=loop", "eta=0.05", "alpha-on=0.8"]) == \
        RemaskOptions(schedule="loop", eta=0.05, alpha_on=0.8)
    assert parse_sampler_options("confidence", ["score=margin"]) == ConfidenceOptions(score="margin")
    assert parse_sampler_options("ancestral", []) is None
    for sampler, pairs, match in (("remdm", ["eta"], "write KEY=VALUE"), ("remdm", ["speed=2"], "KEY one of"),
                                  ("remdm", ["eta=fast"], "eta must be a number"),
                                  ("first-hitting", ["k=2"], "takes no options")):
        with pytest.raises(PlanError, match=match):
            parse_sampler_options(sampler, pairs)


@pytest.mark.parametrize("process,refused", [
    (UniformDiffusion(make_schedule("linear"), 5), ("first-hitting", "confidence", "remdm")),
    (LearnedDiffusion(LearnedSchedule(5), 5), ("first-hitting", "remdm")),
    (AbsorbingDiffusion(make_schedule("linear"), 5), ()),
])
def test_a_sampler_that_does_not_apply_to_a_process_is_refused_in_one_line(process, refused):
    denoiser = lambda z, t: torch.zeros(*z.shape, 5)  # noqa: E731
    for sampler in ("ancestral", "first-hitting", "confidence", "remdm"):
        plan = SamplingPlan(sampler=sampler, steps=4)
        if sampler in refused:
            with pytest.raises(ValueError, match=f"the {sampler} sampler does not apply to the "
                                                 f"{process.process_name} process: ") as caught:
                process.sample(denoiser, plan, num_samples=1, seq_len=3)
            assert "\n" not in str(caught.value)
        else:
            with torch.no_grad():
                tokens, _ = process.sample(denoiser, plan, num_samples=2, seq_len=3)
            assert bool((tokens < 5).all())


# ------------------------------------------------------------------ budgets: named limits, before any work
@pytest.mark.parametrize("sampler", ["ancestral", "confidence", "remdm"])
def test_an_absurd_budget_is_refused_when_the_plan_is_made(sampler):
    from model.sampling import MAX_STEPS

    with pytest.raises(PlanError, match=f"steps 1,000,000,000,000 is more than MAX_STEPS = {MAX_STEPS:,}") as caught:
        SamplingPlan(sampler=sampler, steps=10 ** 12)
    assert caught.value.field == "steps"
    assert SamplingPlan(sampler=sampler, steps=MAX_STEPS).steps == MAX_STEPS


def test_steps_per_position_and_sample_length_have_limits_checked_before_the_grid_is_built():
    from model.sampling import MAX_SAMPLE_LEN, MAX_STEPS_PER_POSITION, check_budget

    plan = SamplingPlan(steps=100_000)
    with pytest.raises(PlanError, match=r"more than MAX_STEPS_PER_POSITION = 1,024 per position of a sequence of 16 "
                                        r"\(at most 16,384\)"):
        check_budget(plan, 16)
    check_budget(plan, 128)                       # 131,072 allowed
    with pytest.raises(PlanError, match="per position of a block of 64"):
        check_budget(SamplingPlan(steps=100_000, block_len=64), 4096)
    check_budget(SamplingPlan(sampler="first-hitting", steps=100_000), 16)   # no grid: one call per token at most
    with pytest.raises(PlanError, match=f"longer than MAX_SAMPLE_LEN = {MAX_SAMPLE_LEN:,}") as caught:
        check_budget(SamplingPlan(block_len=64), 100_000_000)
    assert caught.value.field == "seq_len"
    # The samplers' own entry refuses it before building a grid of the steps.
    process = AbsorbingDiffusion(make_schedule("linear"), 5)
    with pytest.raises(PlanError, match="MAX_STEPS_PER_POSITION"):
        process.sample(lambda z, t: torch.zeros(*z.shape, 5), SamplingPlan(steps=MAX_STEPS_PER_POSITION * 16 + 1),
                       num_samples=1, seq_len=16)


# ------------------------------------------------------------------ options and records that would change nothing
def test_sampler_options_given_twice_or_of_another_schedule_are_refused():
    with pytest.raises(PlanError, match=r"sampler option eta is given twice \(0.01, then 0.02\)") as caught:
        parse_sampler_options("remdm", ["eta=0.01", "eta=0.02"])
    assert caught.value.field == "options.eta"
    with pytest.raises(PlanError, match="sampler option t_on is the loop schedule's: the cap schedule does not read"):
        parse_sampler_options("remdm", ["t_on=0.6"])
    with pytest.raises(PlanError, match="the rescale schedule does not read it"):
        parse_sampler_options("remdm", ["schedule=rescale", "alpha_on=0.8"])
    assert parse_sampler_options("remdm", ["schedule=loop", "t_on=0.6"]) == RemaskOptions(schedule="loop", t_on=0.6)
    with pytest.raises(PlanError, match="the first-hitting sampler has no time grid") as caught:
        SamplingPlan(sampler="first-hitting", grid="cosine")
    assert caught.value.field == "grid"


def test_a_recorded_first_hitting_plan_with_a_grid_is_refused_naming_the_field():
    """First-hitting has no time grid: a record that names one is not a plan, and says so."""
    record = {**SamplingPlan(sampler="first-hitting").to_dict(), "grid": "cosine"}
    with pytest.raises(PlanError, match="the first-hitting sampler has no time grid") as caught:
        SamplingPlan.from_dict(record)
    assert caught.value.field == "grid"
