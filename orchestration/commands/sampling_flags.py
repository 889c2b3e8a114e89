"""The sampling flags of ``unmask sample``, ``unmask eval`` and ``unmask run``, and the one
``SamplingPlan`` (``model.sampling``) they make: a bad value is a UserError naming its flag.

``unmask sample`` names them plainly (``--steps``, ``--grid``, ``--top-p``, ``--temperature``,
``--block-len``); the commands that sample for a report prefix them (``--sample-steps``, ...).
``--sampler`` and ``--sampler-option KEY=VALUE`` are the same everywhere.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.errors import UserError
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

__all__ = ["REPORT_FLAGS", "REPORT_SAMPLER_HELP", "SAMPLE_FLAGS", "SAMPLER_HELP", "SamplingFlags",
           "add_sampling_arguments", "plan_from_args"]

SAMPLER_HELP = f"""\
samplers (--sampler; --steps is the budget of network calls per sequence, or per block):
  ancestral      reverse steps on the grid, network calls only where a token is revealed (default)
  first-hitting  exact: one network call per generated token (no --steps, or steps >= tokens);
                 fewer steps reveal ceil(tokens / steps) tokens per call (approximate)
  confidence     each step reveals the most confident positions; one call per step (not the model's law)
  remdm          ReMDM: revealed tokens may be masked again; at most one call per step
sampler options (--sampler-option KEY=VALUE, repeatable):
  confidence     score={'|'.join(CONFIDENCE_SCORES)}
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


SAMPLE_FLAGS = SamplingFlags(steps="--steps", grid="--grid", top_p="--top-p", temperature="--temperature",
                             block_len="--block-len", compile="--compile")
REPORT_FLAGS = SamplingFlags(steps="--sample-steps", grid="--sample-grid", top_p="--sample-top-p",
                             temperature="--sample-temperature", block_len=None, compile=None)


def add_sampling_arguments(group: argparse._ActionsContainer, flags: SamplingFlags) -> None:
    """The plan's flags (``--seed`` is the command's own)."""
    group.add_argument("--sampler", choices=SAMPLERS, default="ancestral",
                       help="how to sample a diffusion export (default: %(default)s; see 'samplers' below)")
    group.add_argument(flags.steps, type=int, dest="plan_steps", metavar="N",
                       help="budget of network calls per sequence: reverse or unmasking steps (default: the "
                            "sampler's: first-hitting one call per token, the others 1000)")
    group.add_argument(flags.grid, choices=GRIDS, default="uniform", dest="plan_grid",
                       help="time grid of the steps (default: %(default)s)")
    group.add_argument(flags.top_p, type=float, metavar="P", dest="plan_top_p",
                       help="nucleus: keep the most likely tokens holding mass P, in (0, 1] (default: all)")
    group.add_argument(flags.temperature, type=float, default=1.0, metavar="T", dest="plan_temperature",
                       help="divide the logits by T > 0 (default: %(default)s)")
    if flags.block_len is not None:
        group.add_argument(flags.block_len, type=int, metavar="N", dest="plan_block_len",
                           help="semi-autoregressive: generate blocks of N tokens left to right, each with the text "
                                "before it as context (sequences beyond the network's max_seq_len)")
    if flags.compile is not None:
        group.add_argument(flags.compile, choices=COMPILE_SETTINGS, default="auto", dest="compile",
                           help="torch.compile the network's blocks: auto does on a GPU when the samples pass "
                                "32M tokens or more through it (default: %(default)s)")
    group.add_argument("--sampler-option", action="append", default=[], metavar="KEY=VALUE", dest="plan_options",
                       help="an option of the sampler (repeatable; see 'sampler options' below)")


def plan_from_args(args: argparse.Namespace, flags: SamplingFlags, seed: int) -> SamplingPlan:
    """The plan the flags describe; a UserError naming the flag of a bad value."""
    names = {"sampler": "--sampler", "steps": flags.steps, "grid": flags.grid, "top_p": flags.top_p,
             "temperature": flags.temperature, "block_len": flags.block_len, "seed": "--seed",
             "options": "--sampler-option", "compile": flags.compile or "--compile"}
    try:
        return SamplingPlan(sampler=args.sampler, steps=args.plan_steps, grid=args.plan_grid, top_p=args.plan_top_p,
                            temperature=args.plan_temperature, seed=seed,
                            block_len=getattr(args, "plan_block_len", None), compile=getattr(args, "compile", "auto"),
                            options=parse_sampler_options(args.sampler, args.plan_options))
    except PlanError as err:
        flag = names.get(err.field.split(".")[0], "--sampler-option")
        raise UserError(f"{flag}: {err}") from None
