"""Fast tests of the trainer's parts: config, batch plan, ZeRO choice, LR, EMA, objective slots, FLOPs."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from common.errors import UserError
from model.process import low_discrepancy_times
from model.spec import build_trainable
from model.transformer import Transformer, preset
from pipeline.config import Config, OptimSection, config_differences, load_config, parse_overrides
from pipeline.distributed import init_distributed
from pipeline.run_dir.rank_files import full_state
from pipeline.training.ema import EMA, ema_decay
from pipeline.training.engine import (
    activation_memory_bytes,
    build_optimizer,
    choose_zero_stage,
    deepspeed_config,
    model_state_bytes,
    plan_batches,
    plan_training,
)
from pipeline.training.lr_schedule import lr_multiplier
from pipeline.training.objective import (
    EngineDenoiser,
    MicroBatchSlot,
    engine_model,
    make_objective,
    row_generators,
    step_generator,
)
from pipeline.training.throughput import flops_per_token
from tests.support.cli_runner import DISTRIBUTED_ENV, run_unmask
from tests.support.paths import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
TIMED = {"model.time_conditioning": "true"}  # uniform and learned need t (a config check)


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_validate(path):
    config = load_config(path)
    assert config.model.preset in ("tiny", "small", "medium")


def test_paper_recipe_in_the_medium_config():
    config = load_config(REPO / "configs" / "medium.yaml")
    assert (config.optim.lr, config.optim.betas, config.optim.weight_decay) == (3e-4, (0.9, 0.999), 0.0)
    assert (config.train.global_batch_size, config.train.ema_decay) == (512, 0.9999)


def test_yaml_errors_name_the_file_and_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(UserError, match=r"bad.yaml: unknown field optim.learning_rate"):
        load_config(path)
    path.write_text("train:\n  global_batch_size: many\n")
    with pytest.raises(UserError, match=r"field train.global_batch_size = 'many': expected an integer"):
        load_config(path)
    path.write_text("train:\n  zero_stage: 4\n")
    with pytest.raises(UserError, match=r"train.zero_stage = 4: choose one of \['auto', 1, 2, 3\]"):
        load_config(path)
    with pytest.raises(UserError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_validation_names_the_field():
    with pytest.raises(UserError, match=r"config field optim.lr = -1.0: must be a positive number"):
        load_config(None, {"optim.lr": "-1"})
    with pytest.raises(UserError, match=r"train.micro_batch_size = 5: must divide train.global_batch_size = 512"):
        load_config(None, {"train.micro_batch_size": "5"})
    with pytest.raises(UserError, match=r"model.schedule"):
        load_config(None, {"model.schedule": "sigmoid"})
    for process in ("uniform", "learned"):
        with pytest.raises(UserError, match=rf"model.time_conditioning = False: the {process} process needs it"):
            load_config(None, {"model.process": process})
        assert load_config(None, {"model.process": process, "model.time_conditioning": "true"}).model.time_conditioning


def test_the_process_is_refused_with_the_fields_it_cannot_go_with():
    with pytest.raises(UserError, match=r"model.process = 'uniform': the autoregressive baseline has no diffusion"):
        load_config(None, {"model.process": "uniform", "model.objective": "autoregressive"})
    with pytest.raises(UserError, match=r"train.chunked_cross_entropy = 8: applies to the absorbing process only"):
        load_config(None, {"model.process": "learned", "train.chunked_cross_entropy": "8", **TIMED})
    with pytest.raises(UserError, match=r"model.schedule_args \(model.process = learned\): .* linear or polynomial"):
        load_config(None, {"model.process": "learned", "model.schedule": "cosine", **TIMED})
    with pytest.raises(UserError, match=r"flag --model.process = 'masked': choose one of"):
        load_config(None, {"model.process": "masked"})


def test_the_spec_of_each_process():
    """The learned process starts its exponents at model.schedule; the others use it as is."""
    network = preset("tiny", 64)
    learned = load_config(None, {"model.process": "learned", "model.schedule": "polynomial",
                                 "model.schedule_args": "{power: 2, endpoint_eps: 1.0e-3}", **TIMED})
    spec = learned.model.spec(network)
    assert (spec.process, spec.schedule, spec.schedule_args) == (
        "learned", "learned", {"initial_exponent": 2.0, "endpoint_eps": 1e-3})
    uniform = load_config(None, {"model.process": "uniform", "model.schedule": "cosine", **TIMED})
    uniform = uniform.model.spec(network)
    assert (uniform.process, uniform.schedule, uniform.schedule_args) == ("uniform", "cosine", {})
    assert Config().model.spec(network).process == "absorbing"  # the default


def test_overrides_are_coerced_to_the_declared_types():
    overrides = parse_overrides(["--optim.lr", "1e-4", "--train.zero_stage=3", "--optim.betas", "[0.9, 0.95]",
                                 "--model.schedule_args", "{power: 2}", "--model.schedule", "polynomial"])
    config = load_config(None, overrides)
    assert config.optim.lr == 1e-4 and isinstance(config.optim.lr, float)  # YAML alone reads "1e-4" as text
    assert config.train.zero_stage == 3
    assert config.optim.betas == (0.9, 0.95)
    assert config.model.schedule_args == {"power": 2}
    with pytest.raises(UserError, match="unknown config override --optim.learning_rate"):
        load_config(None, {"optim.learning_rate": "1"})
    with pytest.raises(UserError, match="config overrides look like"):
        parse_overrides(["lr=3"])


def test_config_differences_ignore_resume_safe_fields():
    a = Config().to_dict()
    b = load_config(None, {"train.max_steps": "7", "logging.every": "3", "optim.lr": "1e-4"}).to_dict()
    assert config_differences(a, b) == ["optim.lr: checkpoint 0.0003, now 0.0001"]


def test_bad_config_fails_on_the_command_line_before_any_work(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  ema_decay: 1.5\n")
    run_dir = tmp_path / "run"
    proc = run_unmask(["train", "--config", str(bad), "--data", str(tmp_path), "--run-dir", str(run_dir)])
    assert proc.returncode == 2
    assert "train.ema_decay = 1.5: must lie in [0, 1)" in proc.stderr
    assert not run_dir.exists()


# ------------------------------------------------------------------ batches and engine
def test_batch_plan_derives_accumulation_and_refuses_what_cannot_divide():
    config = load_config(None, {"train.global_batch_size": "64", "train.micro_batch_size": "4"})
    plan = plan_batches(config, 4)
    assert (plan.micro_batch, plan.accumulation) == (4, 4)
    assert plan_batches(load_config(None, {"train.global_batch_size": "64"}), 8).micro_batch == 8
    with pytest.raises(UserError, match="multiple of micro_batch_size x world size = 12"):
        plan_batches(config, 3)
    with pytest.raises(UserError, match="does not divide over 3 ranks"):
        plan_batches(load_config(None, {"train.global_batch_size": "64"}), 3)


def test_zero_stage_choice_is_the_lowest_that_fits():
    params = 355_000_000
    assert choose_zero_stage(params, 8, "bf16", 80 * 2**30) == 1
    stage1 = model_state_bytes(params, 1, 8, "bf16")
    stage2 = model_state_bytes(params, 2, 8, "bf16")
    assert stage2 < stage1
    assert choose_zero_stage(params, 8, "bf16", int(stage1 * 1.9)) == 2  # half the memory holds stage 2 only
    assert choose_zero_stage(params, 8, "bf16", 10**6) == 3


def test_deepspeed_config_has_fp32_accumulation_under_bf16():
    config = load_config(None, {"train.global_batch_size": "16", "train.micro_batch_size": "2",
                                "train.zero_stage": "2", "train.precision": "bf16"})
    ds = deepspeed_config(plan_training(config, preset("tiny", 64), 2, torch.device("cpu")), config.optim)
    assert ds["train_batch_size"] == 16 and ds["gradient_accumulation_steps"] == 4
    assert ds["bf16"]["enabled"] and ds["data_types"]["grad_accum_dtype"] == "fp32"
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_clipping"] == 1.0


# ------------------------------------------------------------------ learning rate
def test_lr_warms_up_linearly_then_follows_the_decay():
    constant = OptimSection(warmup_steps=10, decay="constant")
    assert [lr_multiplier(s, constant, 100) for s in (0, 4, 9, 10, 99)] == [0.1, 0.5, 1.0, 1.0, 1.0]
    cosine = OptimSection(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(10, cosine, 110) == pytest.approx(1.0)
    assert lr_multiplier(60, cosine, 110) == pytest.approx(0.55)
    assert lr_multiplier(110, cosine, 110) == pytest.approx(0.1)
    assert lr_multiplier(500, cosine, 110) == pytest.approx(0.1)


# ------------------------------------------------------------------ EMA
def test_ema_follows_the_formula_with_warmup():
    assert ema_decay(0.9999, 0, True) == pytest.approx(0.1)
    assert ema_decay(0.9999, 90, True) == pytest.approx(91 / 100)
    assert ema_decay(0.9999, 10**9, True) == 0.9999 and ema_decay(0.5, 0, False) == 0.5
    layer = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    ema = EMA(layer, 0.5, warmup=False)
    with torch.no_grad():
        layer.weight.fill_(3.0)
    ema.update()
    assert torch.equal(ema.shadow["weight"], torch.full((1, 2), 2.0))
    with ema.applied():
        assert torch.equal(layer.weight, torch.full((1, 2), 2.0))
    assert torch.equal(layer.weight, torch.full((1, 2), 3.0))  # the live weights come back
    restored = EMA(layer, 0.5, warmup=False)
    restored.load_state_dict(ema.state_dict())
    assert torch.equal(restored.shadow["weight"], ema.shadow["weight"]) and restored.updates == 1


def test_full_state_reassembles_padded_zero3_partitions():
    weight = torch.arange(7.0).view(7, 1)  # 7 elements over 2 ranks: slices of 4, the last padded
    slices = [torch.tensor([0.0, 1, 2, 3]), torch.tensor([4.0, 5, 6, 0])]
    states = [{"partitioned": True, "shapes": {"w": [7, 1]}, "shadow": {"w": s}} for s in slices]
    assert torch.equal(full_state(states)["w"], weight)
    replicated = [{"partitioned": False, "shapes": {"w": [7, 1]}, "shadow": {"w": weight}}]
    assert torch.equal(full_state(replicated)["w"], weight)


@pytest.mark.parametrize("rank,expected", [(0, [0.0, 1, 2]), (1, [3.0, 4, 5]), (2, [6.0, 0, 0])])
def test_a_whole_ema_is_cut_into_the_zero3_partition_of_any_rank(monkeypatch, rank, expected):
    """Resuming on 3 ranks an EMA written by 2: whole tensors (full_state) are cut as ZeRO-3
    cuts parameters, flat and zero-padded to a multiple of the world size."""
    layer = nn.Linear(1, 7, bias=False)
    layer.weight.ds_tensor, layer.weight.ds_shape = torch.zeros(3), torch.Size([7, 1])  # ZeRO-3 on 3 ranks
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank)
    ema = EMA(layer, 0.9)
    ema.load_full_state(full_state([{"partitioned": True, "shapes": {"weight": [7, 1]}, "shadow": {"weight": s}}
                                    for s in (torch.tensor([0.0, 1, 2, 3]), torch.tensor([4.0, 5, 6, 0]))]), 12)
    assert torch.equal(ema.shadow["weight"], torch.tensor(expected)) and ema.updates == 12
    with pytest.raises(ValueError, match="has shape"):
        ema.load_full_state({"weight": torch.zeros(6, 1)}, 12)


# ------------------------------------------------------------------ objective and FLOPs
def test_micro_batch_slots_stratify_times_over_the_global_batch():
    """The times every (rank, micro-batch) draws are together exactly the stratified grid of
    the global batch: one shared u, each slot once."""
    world, micro_batches, batch, seed, step = 2, 3, 4, 7, 11
    drawn = []
    for rank in range(world):
        for micro in range(micro_batches):
            slot = MicroBatchSlot(seed, step, rank, world, micro, micro_batches)
            gen = step_generator(torch.device("cpu"), seed, step)
            drawn.append(low_discrepancy_times(batch, gen, offset=slot.offset(batch),
                                               global_batch_size=slot.global_batch(batch)))
    times = torch.cat(drawn).sort().values
    gaps = times.diff()
    assert times.numel() == world * micro_batches * batch
    assert torch.allclose(gaps, torch.full_like(gaps, 1.0 / times.numel()))


@pytest.mark.usefixtures("one_torch_thread")
@torch.no_grad()
def test_a_steps_times_and_masks_do_not_depend_on_how_ranks_split_the_global_batch():
    """The global batch of 6 split as 1 rank x 6, 2 ranks x 3, 3 ranks x 2 micro-batches of
    1, ...: each sequence gets the time and the masks of its place in the global batch, so
    the step's loss is the same on any number of ranks (a run resumed on another continues)."""
    network = Transformer(preset("tiny", 11, n_layers=1, d_model=16, n_heads=2, max_seq_len=8)).eval()
    objective = make_objective(Config().model.spec(network.config), validate=True)
    x0 = torch.randint(0, 11, (6, 8), generator=torch.Generator().manual_seed(1))
    seed, step = 3, 5
    # Each sequence alone, as the micro-batch of one at its place p (rank p of 6).
    alone = [float(objective.loss_sum(network, x0[p:p + 1], MicroBatchSlot(seed, step, p, 6, 0, 1)))
             for p in range(6)]
    reference_times = None
    for world, batch in [(1, 6), (2, 3), (3, 2), (2, 1), (1, 2)]:
        micro_batches, times = 6 // (world * batch), [0.0] * 6
        for rank in range(world):
            for micro in range(micro_batches):
                slot = MicroBatchSlot(seed, step, rank, world, micro, micro_batches)
                first = slot.offset(batch)
                t = low_discrepancy_times(batch, step_generator(torch.device("cpu"), seed, step), offset=first,
                                          global_batch_size=slot.global_batch(batch))
                times[first:first + batch] = t.tolist()
                loss = float(objective.loss_sum(network, x0[first:first + batch], slot))
                assert loss == pytest.approx(sum(alone[first:first + batch]), rel=1e-6), (world, batch, slot)
        reference_times = reference_times or times
        assert times == reference_times, (world, batch)


def test_the_learned_objective_is_the_modules_bound_at_the_slots_times():
    """The learned process's bound runs in the trained module's forward, at the times and
    masks DiffusionObjective would draw for the same slot; its state metrics are the spread
    of the live exponents."""
    spec = load_config(None, {"model.process": "learned", **TIMED}).model.spec(
        preset("tiny", 11, n_layers=1, d_model=16, n_heads=2, max_seq_len=8))
    torch.manual_seed(0)
    trained = build_trainable(spec)
    objective = make_objective(spec, validate=True)
    x0 = torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(1))
    slot = MicroBatchSlot(seed=3, step=5, rank=1, world_size=2, micro=1, micro_batches=2)
    t = low_discrepancy_times(4, step_generator(torch.device("cpu"), 3, 5), offset=slot.offset(4),
                              global_batch_size=slot.global_batch(4))
    masks = row_generators(torch.device("cpu"), slot, 4)
    by_hand = trained.process.nelbo(trained.network, x0, t, masks, reconstruction="uniform").sum()
    assert torch.equal(objective.loss_sum(trained, x0, slot), by_hand)
    with torch.no_grad():
        trained.schedule.theta.copy_(torch.linspace(-2.0, 2.0, 11))
    metrics = objective.state_metrics(trained)
    w = trained.schedule.exponents().detach()
    assert metrics == {"schedule/exponent_min": float(w.min()), "schedule/exponent_median": float(w[5]),
                       "schedule/exponent_max": float(w.max())}
    assert make_objective(Config().model.spec(spec.network), validate=True).state_metrics(trained) == {}


def test_theta_is_optimized_without_weight_decay():
    spec = load_config(None, {"model.process": "learned", **TIMED}).model.spec(preset("tiny", 11, n_layers=1))
    trained = build_trainable(spec)
    groups = build_optimizer(trained, OptimSection(weight_decay=0.1), torch.device("cpu")).param_groups
    theta = trained.schedule.theta
    assert [group["weight_decay"] for group in groups if any(p is theta for p in group["params"])] == [0.0]
    assert sum(len(group["params"]) for group in groups) == len(list(trained.parameters()))


def test_activation_memory_counts_the_whole_prediction_and_the_draws():
    network, tokens = preset("small", 50257), 8 * 1024
    absorbing = activation_memory_bytes(network, 8, 1024, "bf16")
    uniform = activation_memory_bytes(network, 8, 1024, "bf16", process="uniform")
    learned = activation_memory_bytes(network, 8, 1024, "bf16", process="learned")
    assert uniform - absorbing == tokens * network.vocab_size * (20 - 8)  # the same rows, more kept per logit
    assert learned == 2 * uniform  # two draws of every sequence through the network


def test_flops_per_token_follows_the_stated_formula():
    n = sum(p.numel() for p in Transformer(preset("tiny", 50257)).parameters())
    assert flops_per_token(preset("tiny", 50257), 256) == 6 * n + 12 * 4 * 256 * 256
    medium = flops_per_token(preset("medium", 50257), 1024)
    assert 6 * 350e6 < medium < 6 * 360e6 + 12 * 24 * 1024 * 1024  # GPT-2 medium: about 355M parameters


def test_the_engine_denoiser_calls_the_engine_and_keeps_the_network_time_independence():
    """DeepSpeed's engine forwards calls, not attributes: the objective's wrapper of it
    passes every denoiser call through the engine and reads time independence off its module."""

    class Engine(nn.Module):  # what the wrapper relies on: calls forwarded, the network in .module
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module, self.calls = module, []

        def forward(self, *args, **kwargs):
            self.calls.append(sorted(kwargs))
            return self.module(*args, **kwargs)

    for time_conditioning in (False, True):
        engine = Engine(Transformer(preset("tiny", 11, n_layers=1, d_model=16, n_heads=2,
                                           time_conditioning=time_conditioning)))
        denoiser = EngineDenoiser(engine)
        assert denoiser.time_independent is not time_conditioning
        z, t = torch.randint(0, 12, (2, 8)), torch.rand(2)
        selected = torch.rand(2, 8) < 0.5
        targets = torch.randint(0, 11, (int(selected.sum()),))
        with torch.no_grad():
            assert torch.equal(denoiser.logits_at(z, t, selected), engine.module(z, t, output_mask=selected))
            assert torch.equal(denoiser.nll_at(z, t, selected, targets, 3),
                               engine.module(z, t, output_mask=selected, targets=targets, chunk_rows=3))
            assert torch.equal(denoiser.logits(z, t), engine.module(z, t))
        assert engine.calls == [["output_mask"], ["chunk_rows", "output_mask", "targets"], []]
        assert isinstance(engine_model(engine), EngineDenoiser)  # what the trainer hands an objective
    learned = load_config(None, {"model.process": "learned", **TIMED}).model.spec(preset("tiny", 11, n_layers=1))
    engine = Engine(build_trainable(learned))  # a NetworkWithSchedule: the engine's forward is the bound
    assert engine_model(engine) is engine


def test_a_lone_process_leaves_no_launcher_variables_behind(monkeypatch):
    """A world of one sets RANK, MASTER_PORT, ... for itself and removes them at shutdown: a Ray
    head or a child started later by the same process would rendezvous on that port."""
    for name in DISTRIBUTED_ENV:
        monkeypatch.delenv(name, raising=False)
    group = init_distributed(deepspeed_backend=False)
    assert (group.rank, group.world_size, os.environ["MASTER_ADDR"]) == (0, 1, "127.0.0.1")
    group.shutdown()
    assert [name for name in DISTRIBUTED_ENV if name in os.environ] == []


def test_a_launchers_variables_stay_after_shutdown(monkeypatch):
    launcher = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    init_distributed(deepspeed_backend=False).shutdown()
    assert {name: os.environ.get(name) for name in launcher} == launcher
