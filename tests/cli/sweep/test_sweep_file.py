"""The sweep file and its plan: fields refused in one line, steps from the budget by MFU's FLOPs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import yaml

from common.errors import UserError
from model.transformer import PRESETS, parameter_counts
from orchestration.sweep import load_sweep, plan_sweep
from orchestration.sweep.plan import ladder_shape
from orchestration.sweep.spec import SizeSpec
from pipeline.training.build import network_config
from tests.cli.sweep.conftest import SWEEP
from tests.support.cli_runner import unmask_in_process


def test_steps_are_the_budget_over_the_training_flops_of_a_step(sweep_file, tinyshakespeare_shards):
    plan = plan_sweep(load_sweep(sweep_file(budgets=[4e9, 8e9], sizes=[{"d_model": 32}, {"d_model": 64}],
                                            processes={"ar": {"model.objective": "autoregressive"},
                                                       "bd3": {"model.block_size": 4}})))
    assert [t.name for t in plan.trials][:2] == ["ar-C4e9-d32-l1", "ar-C4e9-d64-l1"]
    assert len(plan.trials) == 8
    for trial in plan.trials:
        config = trial.config
        network = network_config(config.model, plan_manifest(tinyshakespeare_shards))
        n = parameter_counts(replace(network, vocab_multiple=1)).total
        attention = 12 * network.n_layers * network.d_model
        # MFU's convention: 6N + 12 L d T; block diffusion's step also runs the clean half (no head)
        expected = 6 * n + attention * 64 if config.model.block_size is None else (
            6 * n + 6 * (n - network.vocab_size * network.d_model) + attention * (64 + 2 * 4))
        assert trial.flops_per_token == pytest.approx(expected)
        assert trial.parameters == n and trial.tokens_per_step == config.train.global_batch_size * 64
        assert trial.steps == int(trial.budget // (expected * trial.tokens_per_step))
        assert config.train.max_steps == trial.steps and config.eval.every == 0 and config.eval.batches == 2
        assert config.optim.warmup_steps == round(0.1 * trial.steps)
        assert config.checkpoint.every == math.ceil(trial.steps / 2)
    by_name = {t.name: t for t in plan.trials}
    assert by_name["bd3-C4e9-d32-l1"].steps < by_name["ar-C4e9-d32-l1"].steps   # the same budget buys fewer
    assert by_name["ar-C8e9-d32-l1"].steps in (2 * by_name["ar-C4e9-d32-l1"].steps,
                                              2 * by_name["ar-C4e9-d32-l1"].steps + 1)


def plan_manifest(shards):
    from data_prep.shards.format import Manifest

    return Manifest.read(shards)


def test_the_ladder_derives_depth_from_width_through_the_presets():
    assert ladder_shape(SizeSpec(preset="small")).n_layers == PRESETS["small"]["n_layers"]
    assert ladder_shape(SizeSpec(d_model=256)) == replace(ladder_shape(SizeSpec(preset="tiny")), name="d256-l4")
    assert ladder_shape(SizeSpec(d_model=768)).n_layers == 12
    assert ladder_shape(SizeSpec(d_model=128)).n_layers == 2     # below tiny depth follows width
    assert 4 < ladder_shape(SizeSpec(d_model=512)).n_layers < 12
    assert 12 < ladder_shape(SizeSpec(d_model=896)).n_layers < 24
    shape = ladder_shape(SizeSpec(d_model=512, n_layers=3))
    assert (shape.n_layers, shape.n_heads, shape.name) == (3, 8, "d512-l3")


@pytest.mark.parametrize(("fields", "named"), [
    ({"budgets": [4e9, -1]}, "field budgets[1] = -1: must be > 0"),
    ({"budgets": "lots"}, "field budgets = 'lots': expected a non-empty list"),
    ({"budgets": [4e9, 4e9]}, "a budget appears twice"),
    ({"sizes": ["huge"]}, "field sizes[0] = 'huge': choose a preset"),
    ({"sizes": [{"d_model": 32, "depth": 2}]}, "field sizes[0].depth"),
    ({"sizes": [{"d_model": 32}, {"d_model": 32}]}, "field sizes: the size d32-l1 appears twice"),
    ({"processes": {"bad name": {}}}, "field processes = 'bad name'"),
    ({"processes": {"ar": {"objective": "autoregressive"}}}, "field processes.ar"),
    ({"processes": {"ar": {"model.objective": "causal"}}}, "processes.ar: flag --model.objective"),
    ({"reference": "ar"}, "field reference = 'ar': choose one of the processes ['mdlm']"),
    ({"warmup_fraction": 1.5}, "field warmup_fraction = 1.5: must lie in [0, 1)"),
    ({"min_steps": 2.5}, "field min_steps = 2.5: expected an integer"),
    ({"resources": {"tpus": 4}}, "field resources"),
    ({"epochs": 3}, "unknown field epochs"),
    ({"min_steps": 10_000}, "point mdlm-C4e9-d32-l1: budget 4e+09 FLOPs"),
    ({"budgets": [1e13]}, "more than max_epochs = 1 of the 240640 the prep's train split holds"),
    ({"processes": {"bd3": {"model.block_size": 5}}}, "point bd3-C4e9-d32-l1: config field model.block_size = 5"),
])
def test_a_bad_sweep_file_is_refused_in_one_line_naming_the_field(sweep_file, fields, named):
    with pytest.raises(UserError) as refusal:
        plan_sweep(load_sweep(sweep_file(**fields)))
    message = str(refusal.value)
    assert named in message and "\n" not in message and "sweep.yaml" in message


def test_a_missing_field_or_file_is_refused(tmp_path, sweep_file):
    path = sweep_file()
    raw = yaml.safe_load(path.read_text())
    del raw["budgets"]
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match="field budgets is missing"):
        load_sweep(path)
    with pytest.raises(UserError, match="cannot read the sweep file"):
        load_sweep(tmp_path / "absent.yaml")
    path.write_text("budgets: [1e9\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_sweep(path)


def test_dry_run_prints_every_trial_and_runs_nothing(sweep_file, tmp_path, capsys):
    path = sweep_file(sizes=[{"d_model": 32}, {"d_model": 64}])
    assert unmask_in_process(["sweep", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "2 trials" in printed and "mdlm-C4e9-d64-l1" in printed and not (tmp_path / "out").exists()
    assert SWEEP["budgets"] == [4e9]
