"""The trials of a sweep: every (process, budget, size), its config, FLOPs per token and steps.

A trial's config is the sweep's base config with the process's overrides, the size's shape, and
what the budget decides: ``train.max_steps`` = budget / (FLOPs per token x tokens per step), the
FLOPs per token being MFU's (``pipeline.training.build.training_flops_per_token``: 6 N + 12 x
layers x d_model x seq_len, block diffusion's on the work it does), a warmup that is a fraction of
the steps, evenly spaced checkpoints (a killed trial resumes from them) and one validation at the
end (the trial's bound). A point under ``min_steps`` or past ``max_epochs`` of the prep's train
split is refused in one line naming it, before any trial runs. Sizes between presets follow one
rule (``ladder_shape``). The manual: docs/scaling.md#budgets-sizes-and-steps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from common.errors import UserError
from data_prep.shards.format import Manifest
from data_prep.shards.storage import read_manifest
from model.transformer import PRESETS, parameter_counts
from orchestration.sweep.spec import SizeSpec, SweepSpec
from pipeline.config import Config, load_config
from pipeline.training.build import network_config, training_flops_per_token

__all__ = ["HEAD_DIM", "Shape", "SweepPlan", "Trial", "budget_name", "ladder_shape", "plan_sweep"]

HEAD_DIM = 64   # every preset's d_model / n_heads: a derived width keeps it


@dataclass(frozen=True)
class Shape:
    """A network's depth, width and heads, and the name trials and plots call it by."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int


def _preset_points() -> list[tuple[float, float]]:
    """(ln d_model, ln n_layers) of the presets, by width."""
    return sorted((math.log(p["d_model"]), math.log(p["n_layers"])) for p in PRESETS.values())


def ladder_shape(size: SizeSpec) -> Shape:
    """A preset as it is; a width's depth from the presets' aspect: ln n_layers piecewise linear
    in ln d_model through the presets (tiny 4 x 256, small 12 x 768, medium 24 x 1024), the end
    segments extended (below tiny depth grows as width: 128 wide is 2 layers); heads of 64."""
    if size.preset is not None:
        preset = PRESETS[size.preset]
        return Shape(size.preset, preset["n_layers"], preset["d_model"], preset["n_heads"])
    width = size.d_model
    points, x = _preset_points(), math.log(width)
    segment = next((i for i in range(len(points) - 1) if x <= points[i + 1][0]), len(points) - 2)
    (x0, y0), (x1, y1) = points[segment], points[segment + 1]
    depth = size.n_layers or max(1, round(math.exp(y0 + (x - x0) * (y1 - y0) / (x1 - x0))))
    heads = size.n_heads or max(1, width // HEAD_DIM)
    return Shape(f"d{width}-l{depth}", depth, width, heads)


def budget_name(budget: float) -> str:
    """``3e+12`` as ``3e12``: how trial names and plots write a budget."""
    mantissa, _, exponent = f"{budget:.2g}".partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


@dataclass(frozen=True)
class Trial:
    """One point of the sweep and the config it trains with."""

    name: str                 # PROCESS-CBUDGET-SIZE: its run directory under trials/
    process: str
    budget: float
    shape: Shape
    parameters: int           # N of the FLOPs convention (true vocabulary, every parameter once)
    flops_per_token: float
    tokens_per_step: int
    steps: int
    config: Config

    def record(self) -> dict:
        """What the summary and MLflow say of the point."""
        return {"name": self.name, "process": self.process, "budget": self.budget, "size": self.shape.name,
                "n_layers": self.shape.n_layers, "d_model": self.shape.d_model, "n_heads": self.shape.n_heads,
                "parameters": self.parameters, "flops_per_token": self.flops_per_token,
                "tokens_per_step": self.tokens_per_step, "steps": self.steps,
                "flops": self.flops_per_token * self.tokens_per_step * self.steps}


@dataclass(frozen=True)
class SweepPlan:
    """Every trial of a sweep, on the data of one prep."""

    spec: SweepSpec
    data: str
    seq_len: int
    train_tokens: int
    trials: tuple[Trial, ...]


def _overrides(values: dict) -> dict[str, str]:
    """Config overrides as ``load_config`` takes them: JSON is YAML."""
    return {key: json.dumps(value) for key, value in values.items()}


def _base_config(spec: SweepSpec, process: str, overrides: dict) -> Config:
    try:
        return load_config(spec.config, _overrides({**spec.processes[process], **overrides}))
    except UserError as err:
        raise UserError(f"{spec.source}: processes.{process}: {err}") from None


def _trial(spec: SweepSpec, manifest: Manifest, data: str, process: str, budget: float, shape: Shape,
           train_tokens: int) -> Trial:
    name = f"{process}-C{budget_name(budget)}-{shape.name}"
    sized = _base_config(spec, process, {"model.n_layers": shape.n_layers, "model.d_model": shape.d_model,
                                         "model.n_heads": shape.n_heads, "data.path": data})
    try:
        network = network_config(sized.model, manifest)
    except UserError as err:
        raise UserError(f"{spec.source}: point {name}: {err}") from None
    flops = training_flops_per_token(sized, network, manifest.seq_len)
    tokens_per_step = sized.train.global_batch_size * manifest.seq_len
    steps = int(budget // (flops * tokens_per_step))
    where = (f"{spec.source}: point {name}: budget {budget:g} FLOPs at {flops:.3g} FLOPs per token and "
             f"{tokens_per_step} tokens per step is {steps} steps")
    if steps < spec.min_steps:
        raise UserError(f"{where}, fewer than min_steps = {spec.min_steps}; raise the budget, drop the size "
                        f"from sizes, or lower train.global_batch_size in {spec.config}")
    if steps * tokens_per_step > spec.max_epochs * train_tokens:
        raise UserError(f"{where}: {steps * tokens_per_step} tokens, more than max_epochs = {spec.max_epochs:g} "
                        f"of the {train_tokens} the prep's train split holds ({data}); lower the budget, "
                        f"prepare more data, or raise max_epochs")
    config = replace(sized, train=replace(sized.train, max_steps=steps),
                     optim=replace(sized.optim, warmup_steps=round(spec.warmup_fraction * steps)),
                     eval=replace(sized.eval, every=0, batches=spec.eval_batches),
                     checkpoint=replace(sized.checkpoint, every=max(1, math.ceil(steps / spec.checkpoints))),
                     logging=replace(sized.logging, run_name=name, progress=False))
    parameters = parameter_counts(replace(network, vocab_multiple=1)).total
    return Trial(name, process, budget, shape, parameters, flops, tokens_per_step, steps, config.validate())


def plan_sweep(spec: SweepSpec) -> SweepPlan:
    """Every trial of ``spec``, checked; the first point that cannot run is refused."""
    base = _base_config(spec, next(iter(spec.processes)), {})
    data = spec.data or base.data.path
    if data is None:
        raise UserError(f"{spec.source}: field data is missing and {spec.config} sets no data.path; name the "
                        f"`unmask prep --out` directory the trials train on")
    if "://" not in data:  # trials run in Ray's workers, whatever their working directory
        data = str(Path(data).resolve())
    manifest = read_manifest(data, flag=f"{spec.source}: field data")
    split = manifest.splits.get(base.data.train_split)
    train_tokens = (split.sequences if split else 0) * manifest.seq_len
    shapes = [ladder_shape(size) for size in spec.sizes]
    names = [shape.name for shape in shapes]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise UserError(f"{spec.source}: field sizes: the size {twice} appears twice")
    trials = tuple(_trial(spec, manifest, data, process, budget, shape, train_tokens)
                   for process in spec.processes for budget in spec.budgets for shape in shapes)
    return SweepPlan(spec, data, manifest.seq_len, train_tokens, trials)
