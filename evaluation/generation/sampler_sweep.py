"""Sample quality against network calls, per sampler: the table researchers compare samplers by.

    rows = sampler_sweep(exported, SamplingPlan(), reference, num=16)
    for row in rows: print(row.sampler, row.budget, row.network_calls, row.generative_perplexity)

For every sampler the export's process takes (``model.sampling``) and every budget of network
calls (``SWEEP_BUDGETS`` by default: 16 to 1024), ``num`` samples are drawn with the base
plan's temperature, nucleus, grid (first-hitting and threshold have none) and seed and that sampler's default
options, and scored (``evaluation.generation.sample_quality``): the mean network calls a
sample actually needed, the generative perplexity of their text under the reference (None
without one) and their mean unigram entropy. Read the two together: a sampler that repeats itself gets a low entropy and
a flattering perplexity. ``unmask eval --sample-sweep`` puts the table and its plot in the
report; ``bench/sampler_quality.py`` prints it for BENCHMARKS.md. An autoregressive export has
one way to sample and no budget: ``sweep_samplers`` refuses it (a UserError).
See docs/sampling.md#which-sampler-at-which-budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from common.errors import UserError
from common.progress import bar as progress_bar
from evaluation.generation.generate import DEFAULT_BATCH_SIZE, generate
from evaluation.generation.sample_quality import ReferenceModel, score_samples
from evaluation.results import SweepRow
from model.sampling import SAMPLERS, SamplingPlan
from model.sampling.plan import UNBUDGETED
from pipeline.interchange.export import Exported

__all__ = ["SWEEP_BUDGETS", "sampler_sweep", "sweep_samplers"]

SWEEP_BUDGETS = (16, 32, 64, 128, 256, 1024)


def sweep_samplers(exported: Exported) -> tuple[str, ...]:
    """The samplers the export's process takes, in ``SAMPLERS`` order; a UserError for an
    autoregressive export, which has none to compare."""
    if exported.spec.objective == "autoregressive":
        raise UserError("--sample-sweep compares the samplers of a diffusion export at budgets of network calls; an "
                        "autoregressive export samples one way, one call per token: leave --sample-sweep out")
    process = exported.process(validate=False)
    return tuple(name for name in SAMPLERS if name in process.samplers)


def sampler_sweep(exported: Exported, base: SamplingPlan, reference: ReferenceModel | None, *, num: int,
                  budgets: Sequence[int] = SWEEP_BUDGETS, samplers: Sequence[str] | None = None,
                  batch_size: int = DEFAULT_BATCH_SIZE, device: str = "cpu") -> list[SweepRow]:
    """The quality of ``num`` samples per sampler and budget (module docstring)."""
    samplers = sweep_samplers(exported) if samplers is None else tuple(samplers)
    rows = []
    for sampler, budget in progress_bar([(s, b) for s in samplers for b in budgets], desc="sweep", unit="plan"):
        plan = replace(base, sampler=sampler, steps=budget, options=None,
                       grid="uniform" if sampler in UNBUDGETED else base.grid)
        samples = generate(exported, plan, num=num, batch_size=batch_size, device=device)
        quality = score_samples(samples, exported.tokenizer, reference)
        perplexity = quality.generative_perplexity
        rows.append(SweepRow(sampler=sampler, budget=budget,
                             network_calls=sum(s.network_calls for s in samples) / len(samples),
                             mean_unigram_entropy=quality.mean_unigram_entropy,
                             generative_perplexity=perplexity.perplexity if perplexity else None))
    return rows
