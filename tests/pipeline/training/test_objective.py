"""The training objective of a micro-batch (``pipeline.training.objective``): the times and
masks of each slot of the global batch, whatever the ranks; the learned process's bound and
state metrics; the wrapper of DeepSpeed's engine; and the host reads of a training micro-step."""

from __future__ import annotations

import traceback
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from model.process import low_discrepancy_times
from model.spec import ModelSpec, build_trainable
from model.transformer import Transformer, preset
from pipeline.config import Config, load_config
from pipeline.training.ema import EMA
from pipeline.training.objective import (
    EngineDenoiser,
    MicroBatchSlot,
    engine_model,
    make_objective,
    row_generators,
    step_generator,
)
from tests.support.paths import REPO
from tests.support.small_networks import small_network, token_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTH, BATCH = 64, 4
_net = partial(small_network, LENGTH)
_batch = partial(token_batch, BATCH, LENGTH)

TIMED = {"model.time_conditioning": "true"}  # uniform and learned need t (a config check)


# ------------------------------------------------------------------ the slots of the global batch
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


# ------------------------------------------------------------------ the objectives
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


# ------------------------------------------------------------------ host reads
# Ops whose result the host must read back (on a GPU, each waits for the queued work).
HOST_READS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::masked_select",
              "aten::equal", "aten::unique_consecutive", "aten::_unique2"}

MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"}


class _HostReads(TorchDispatchMode):
    """Every host read of the ops run inside it, with the function of ours that made it, and
    the number of matmuls run before it."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str, int]] = []
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in HOST_READS:
            ours = [f for f in traceback.extract_stack()
                    if f.filename.startswith(str(REPO)) and "/tests/" not in f.filename
                    and "site-packages" not in f.filename]  # CI's .venv lies inside REPO
            where = f"{Path(ours[-1].filename).relative_to(REPO)}:{ours[-1].name}" if ours else "?"
            self.reads.append((name, where, self.matmuls))
        self.matmuls += name in MATMULS
        return func(*args, **(kwargs or {}))


def test_a_training_micro_step_reads_the_device_only_for_the_masked_count_before_any_matmul():
    """The objective's loss, its backward and the EMA update as the trainer runs them on a GPU
    (validate=False): the only reads of device data are the masked positions' count (one
    nonzero in the bound, one in the network, both before the first matmul of the forward, so
    the device never drains mid-step); the schedule's endpoint rate is read from a host tensor."""
    spec = ModelSpec(network=_net().config)
    objective = make_objective(spec, validate=False)
    net = _net()
    ema = EMA(net, 0.99)
    slot = MicroBatchSlot(seed=0, step=3, rank=0, world_size=1, micro=0, micro_batches=1)
    with _HostReads() as reads:
        loss_sum = objective.loss_sum(net, _batch(), slot)
        (loss_sum / (BATCH * LENGTH)).backward()
        ema.update()
    assert reads.matmuls > 0
    assert sorted({(name, where) for name, where, _ in reads.reads}) == [
        ("aten::_local_scalar_dense", "model/absorbing.py:_endpoint_masking_rate"),  # a host tensor (t = 0)
        # The schedule's checks of its input: the step's times, made on the host.
        ("aten::_local_scalar_dense", "model/checks.py:check_schedule_times"),
        ("aten::nonzero", "model/absorbing.py:masked_nll"),
        ("aten::nonzero", "model/transformer.py:_selected_rows")]
    assert [matmuls for name, _, matmuls in reads.reads if name == "aten::nonzero"] == [0, 0]
