"""The sampling flags of ``unmask sample``, ``unmask eval`` and ``unmask run``, and the one
``SamplingPlan`` (``model.sampling``) they make: a bad value is a UserError naming its flag.

``unmask sample`` names them plainly (``--steps``, ``--grid``, ``--top-p``, ``--temperature``,
``--block-len``); the commands that sample for a report prefix them (``--sample-steps``, ...).
``--sampler`` and ``--sampler-option KEY=VALUE`` are the same everywhere.

Every flag defaults to None on the command line, so ``given_flags`` knows which ones the user
gave: a flag that would change nothing (``--steps`` for an autoregressive export, eval's
sampler flags without ``--num-samples``) is refused instead of ignored.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common.errors import UserError
from common.outputs import json_object
from model.sampling import (
    COMPILE_SETTINGS,
    CONFIDENCE_SCORES,
    GRIDS,
    REMASK_SCHEDULES,
    SAMPLERS,
    PlanError,
    SamplingPlan,
    parse_sampler_options,
)
from pipeline.interchange.export import CONFIG_FILE, resolve_export
from pipeline.run_dir.layout import RunLayout

__all__ = ["REPORT_FLAGS", "REPORT_SAMPLER_HELP", "SAMPLE_FLAGS", "SAMPLER_HELP", "SamplingFlags",
           "add_sampling_arguments", "check_flags_apply", "check_samples_drawn", "given_flags", "objective_of",
           "plan_from_args"]

SAMPLER_HELP = f"""\
samplers (--sampler; --steps is the budget of network calls per sequence, or per block):
  ancestral      reverse steps on the grid, network calls only where a token is revealed (default)
  first-hitting  exact: one network call per generated token (no --steps, or steps >= tokens);
                 fewer steps reveal ceil(tokens / steps) tokens per call (approximate)
  confidence     each step reveals the most confident positions; one call per step (not the model's law)
  remdm          ReMDM: revealed tokens may be masked again; at most one call per step
  threshold      each call reveals every position whose confidence passes a threshold, at least one
                 (Fast-dLLM); --steps, when given, caps the calls (not the model's law)
sampler options (--sampler-option KEY=VALUE, repeatable):
  confidence     score={'|'.join(CONFIDENCE_SCORES)}
  threshold      threshold=0.9 min_tokens=1 max_tokens=N score={'|'.join(CONFIDENCE_SCORES)}
  remdm          schedule={'|'.join(REMASK_SCHEDULES)} eta=E (default per schedule: 0.008, 0.015, 0.02)
                 t_on=0.55 t_off=0.05 alpha_on=0.9 (the loop's)
"""

# The same, for the commands that sample for a report (their budget flag is --sample-steps).
REPORT_SAMPLER_HELP = SAMPLER_HELP.replace("--steps", "--sample-steps")


@dataclass(frozen=True)
class SamplingFlags:
    """The names one command gives the plan's fields (None: the command has no such flag)."""

    steps: str
    grid: str
    top_p: str
    temperature: str
    block_len: str | None
    compile: str | None     # None: the command's own --compile (unmask eval's) applies, if it has one
    prefix_cache: str | None = None   # docs/fast-generation.md
    guidance: str | None = None
    whole_sequence: str | None = None
    dual_cache: str | None = None


SAMPLE_FLAGS = SamplingFlags(steps="--steps", grid="--grid", top_p="--top-p", temperature="--temperature",
                             block_len="--block-len", compile="--compile", prefix_cache="--prefix-cache",
                             guidance="--guidance", whole_sequence="--whole-sequence", dual_cache="--dual-cache")
REPORT_FLAGS = SamplingFlags(steps="--sample-steps", grid="--sample-grid", top_p="--sample-top-p",
                             temperature="--sample-temperature", block_len=None, compile=None)


def add_sampling_arguments(group: argparse._ActionsContainer, flags: SamplingFlags) -> None:
    """The plan's flags (``--seed`` is the command's own)."""
    group.add_argument("--sampler", choices=SAMPLERS,
                       help="how to sample a diffusion export (default: ancestral; see 'samplers' below)")
    group.add_argument(flags.steps, type=int, dest="plan_steps", metavar="N",
                       help="budget of network calls per sequence: reverse or unmasking steps (default: the "
                            "sampler's: first-hitting one call per token, the others 1000)")
    group.add_argument(flags.grid, choices=GRIDS, dest="plan_grid",
                       help="time grid of the steps (default: uniform; first-hitting has none)")
    group.add_argument(flags.top_p, type=float, metavar="P", dest="plan_top_p",
                       help="nucleus: keep the most likely tokens holding mass P, in (0, 1] (default: all)")
    group.add_argument(flags.temperature, type=float, metavar="T", dest="plan_temperature",
                       help="divide the logits by T > 0 (default: 1.0)")
    if flags.block_len is not None:
        group.add_argument(flags.block_len, type=int, metavar="N", dest="plan_block_len",
                           help="semi-autoregressive: generate blocks of N tokens left to right, each with the text "
                                "before it as context (sequences beyond the network's max_seq_len)")
    if flags.compile is not None:
        group.add_argument(flags.compile, choices=COMPILE_SETTINGS, default="auto", dest="compile",
                           help="torch.compile the network's blocks: auto does on a GPU when the samples pass "
                                "32M tokens or more through it (default: %(default)s)")
    if flags.prefix_cache is not None:
        group.add_argument(flags.prefix_cache, type=int, metavar="N", dest="plan_prefix_cache",
                           help="with --block-len: cache the finished text's keys and values, recomputed every N "
                                "calls (approximate; 1 is exact; docs/fast-generation.md)")
    if flags.guidance is not None:
        group.add_argument(flags.guidance, type=float, metavar="W", dest="plan_guidance",
                           help="unsupervised classifier-free guidance of weight W >= 0 with --prompt or --infill: "
                                "a second pass with the prompt masked, two network calls a step")
    if flags.whole_sequence is not None:
        group.add_argument(flags.whole_sequence, action="store_true", default=None, dest="plan_whole_sequence",
                           help="with --block-len: every network call sees the whole sequence, the finished text, "
                                "the block and the masked rest (LLaDA's blocks; absorbing exports; "
                                "docs/fast-generation.md)")
    if flags.dual_cache is not None:
        group.add_argument(flags.dual_cache, type=int, metavar="N", dest="plan_dual_cache",
                           help="with --whole-sequence: cache the keys and values of the text before and after the "
                                "block, recomputed every N calls (approximate; 1 is exact; docs/fast-generation.md)")
    group.add_argument("--sampler-option", action="append", metavar="KEY=VALUE", dest="plan_options",
                       help="an option of the sampler (repeatable, each key once; see 'sampler options' below)")


def plan_from_args(args: argparse.Namespace, flags: SamplingFlags, seed: int) -> SamplingPlan:
    """The plan the flags describe; a UserError naming the flag of a bad value."""
    names = {"sampler": "--sampler", "steps": flags.steps, "grid": flags.grid, "top_p": flags.top_p,
             "temperature": flags.temperature, "block_len": flags.block_len, "seed": "--seed",
             "options": "--sampler-option", "compile": flags.compile or "--compile",
             "prefix_cache": flags.prefix_cache, "guidance": flags.guidance,
             "whole_sequence": flags.whole_sequence, "dual_cache": flags.dual_cache}
    sampler = args.sampler or "ancestral"
    try:
        return SamplingPlan(sampler=sampler, steps=args.plan_steps, grid=args.plan_grid or "uniform",
                            top_p=args.plan_top_p,
                            temperature=1.0 if args.plan_temperature is None else args.plan_temperature, seed=seed,
                            block_len=getattr(args, "plan_block_len", None), compile=getattr(args, "compile", "auto"),
                            options=parse_sampler_options(sampler, args.plan_options or []),
                            prefix_cache=getattr(args, "plan_prefix_cache", None),
                            guidance=getattr(args, "plan_guidance", None),
                            whole_sequence=bool(getattr(args, "plan_whole_sequence", None)),
                            dual_cache=getattr(args, "plan_dual_cache", None))
    except PlanError as err:
        flag = names.get(err.field.split(".")[0]) or "--sampler-option"
        raise UserError(f"{flag}: {err}") from None


def given_flags(args: argparse.Namespace, flags: SamplingFlags) -> list[str]:
    """The sampling flags given on the command line (``--seed`` and ``--compile`` are the command's own)."""
    values = (("--sampler", args.sampler), (flags.steps, args.plan_steps), (flags.grid, args.plan_grid),
              (flags.top_p, args.plan_top_p), (flags.temperature, args.plan_temperature),
              (flags.block_len, getattr(args, "plan_block_len", None)), ("--sampler-option", args.plan_options),
              (flags.prefix_cache, getattr(args, "plan_prefix_cache", None)),
              (flags.guidance, getattr(args, "plan_guidance", None)),
              (flags.whole_sequence, getattr(args, "plan_whole_sequence", None)),
              (flags.dual_cache, getattr(args, "plan_dual_cache", None)))
    return [flag for flag, value in values if flag is not None and value is not None]


def check_samples_drawn(args: argparse.Namespace, flags: SamplingFlags, num_samples: int) -> None:
    """Refuse sampling flags when no sample is drawn (a report's ``--num-samples 0``): they would be unused."""
    unused = given_flags(args, flags)
    if unused and not num_samples:
        raise UserError(f"{unused[0]} says how the report's samples are drawn, and there are none: give "
                        f"--num-samples N too (or leave {', '.join(unused)} out)")


def check_flags_apply(args: argparse.Namespace, flags: SamplingFlags, objective: str | None, model: str) -> None:
    """Refuse the budget and grid flags for an autoregressive ``model`` (``objective``; see
    ``objective_of``), which samples left to right at one network call per token: they would
    be ignored. Any other sampler flag it cannot use is refused when the plan meets the export."""
    if objective != "autoregressive":
        return
    ignored = [flag for flag in given_flags(args, flags) if flag in (flags.steps, flags.grid)]
    if ignored:
        raise UserError(f"{ignored[0]}: {model} is an autoregressive model, which samples left to right at one "
                        f"network call per token, with no steps or time grid; leave {' and '.join(ignored)} out")


def objective_of(target: Path) -> str | None:
    """The objective of an export, or of a training run's config; None when it cannot be read
    here (what is wrong with ``target`` is said when it is loaded)."""
    try:
        record = json_object(resolve_export(target) / CONFIG_FILE)
        return record.get("objective") if record else None
    except UserError:  # a training run not exported yet: its config says
        record = json_object(RunLayout(target).config)
        model = record.get("model") if record else None
        return model.get("objective") if isinstance(model, dict) else None
