"""``SamplingPlan``: everything a sampler needs except the network and what to condition on.

One typed value, recorded and passed as it is by every caller (``unmask sample``, ``unmask
eval``'s samples, ``unmask run``, the report, MLflow): the sampler and its budget (``steps``,
network calls per sequence, per block with ``block_len``; None: the sampler's default), the
time grid, temperature and nucleus, the seed, the blocks and the sampler's options. It is
valid by construction: a bad field raises ``PlanError`` (a ValueError) naming it, so a command
line can name its flag. ``cache``, ``static_shape`` and ``compile`` say how to run, never what
to draw, except ``prefix_cache`` and ``dual_cache`` (approximations, named in the plan so they are
never silent), ``guidance`` (a different distribution) and ``whole_sequence`` (blocks whose network
sees the masked suffix too): docs/fast-generation.md. The budget's limits and their
reasons: docs/sampling.md#the-budget.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["COMPILE_SETTINGS", "CONFIDENCE_SCORES", "GRIDS", "MAX_SAMPLE_LEN", "MAX_STEPS", "MAX_STEPS_PER_POSITION",
           "REMASK_SCHEDULES", "SAMPLERS", "ConfidenceOptions", "PlanError", "RemaskOptions", "SamplerOptions",
           "SamplingPlan", "ThresholdOptions", "check_budget", "parse_sampler_options"]

SAMPLERS = ("ancestral", "first-hitting", "confidence", "remdm", "threshold")
# The samplers whose budget is optional: without one they make at most one call per token.
UNBUDGETED = ("first-hitting", "threshold")
GRIDS = ("uniform", "cosine")
CONFIDENCE_SCORES = ("max-prob", "margin")
REMASK_SCHEDULES = ("cap", "rescale", "loop")
COMPILE_SETTINGS = ("auto", "on", "off")  # as ``unmask eval --compile`` and ``train.compile``
# ReMDM's own settings for OpenWebText (Wang et al. 2025, their scripts): eta per schedule,
# and the loop's switch-on time, switch-off time and the alpha held in between.
REMASK_ETA = {"cap": 0.008, "rescale": 0.015, "loop": 0.02}
LOOP_T_ON, LOOP_T_OFF, LOOP_ALPHA_ON = 0.55, 0.05, 0.9
DEFAULT_STEPS = 1000
# The budget's limits and their reasons: docs/sampling.md#the-budget.
MAX_STEPS = 1 << 20
MAX_STEPS_PER_POSITION = 1024
MAX_SAMPLE_LEN = 1 << 20
# The remask options only the loop schedule reads.
LOOP_OPTIONS = ("t_on", "t_off", "alpha_on")


class PlanError(ValueError):
    """A bad field of a sampling plan; ``field`` names it (``options.eta`` for an option)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


def _fail(field_name: str, message: str) -> None:
    raise PlanError(field_name, message)


@dataclass(frozen=True)
class ConfidenceOptions:
    """Confidence-ordered unmasking: how a position's confidence is scored.

    ``max-prob``: the probability of its most likely token (MaskGIT); ``margin``: that minus
    the second most likely one's.
    """

    score: str = "max-prob"

    def __post_init__(self) -> None:
        if self.score not in CONFIDENCE_SCORES:
            _fail("options.score", f"confidence score must be one of {', '.join(CONFIDENCE_SCORES)}, "
                                   f"got {self.score!r}")


@dataclass(frozen=True)
class RemaskOptions:
    """ReMDM's remasking probability sigma_t (``model.sampling.remasking``).

    ``cap``: sigma_t = min(eta, sigma_max); ``rescale``: eta * sigma_max; ``loop``: no
    remasking above ``t_on`` and below ``t_off``, and in between alpha held at ``alpha_on``
    while tokens are remasked with probability eta. ``eta=None`` takes ReMDM's value for the
    schedule (cap 0.008, rescale 0.015, loop 0.02).
    """

    schedule: str = "cap"
    eta: float | None = None
    t_on: float = LOOP_T_ON
    t_off: float = LOOP_T_OFF
    alpha_on: float = LOOP_ALPHA_ON

    def __post_init__(self) -> None:
        if self.schedule not in REMASK_SCHEDULES:
            _fail("options.schedule", f"remask schedule must be one of {', '.join(REMASK_SCHEDULES)}, "
                                      f"got {self.schedule!r}")
        if self.eta is None:
            object.__setattr__(self, "eta", REMASK_ETA[self.schedule])
        if not 0.0 <= self.eta <= 1.0:
            _fail("options.eta", f"remask eta must lie in [0, 1], got {self.eta}")
        if not 0.0 < self.t_off < self.t_on < 1.0:
            _fail("options.t_on", f"remask loop needs 0 < t_off < t_on < 1, got t_off={self.t_off}, "
                                  f"t_on={self.t_on}")
        if not 0.0 < self.alpha_on < 1.0:
            _fail("options.alpha_on", f"remask alpha_on must lie in (0, 1), got {self.alpha_on}")


@dataclass(frozen=True)
class ThresholdOptions:
    """Threshold decoding (Fast-dLLM): each call reveals every masked position whose confidence
    (``score``, as ``ConfidenceOptions``) exceeds ``threshold``, at least ``min_tokens`` (the most
    confident ones) and at most ``max_tokens`` (None: no limit)."""

    threshold: float = 0.9
    min_tokens: int = 1
    max_tokens: int | None = None
    score: str = "max-prob"

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, (int, float)) and 0.0 <= self.threshold <= 1.0):
            _fail("options.threshold", f"threshold must lie in [0, 1], got {self.threshold!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 1:
            _fail("options.min_tokens", f"min_tokens must be an integer >= 1 (a call reveals at least one token), "
                                        f"got {self.min_tokens!r}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < self.min_tokens):
            _fail("options.max_tokens", f"max_tokens must be an integer >= min_tokens ({self.min_tokens}), "
                                        f"got {self.max_tokens!r}")
        if self.score not in CONFIDENCE_SCORES:
            _fail("options.score", f"confidence score must be one of {', '.join(CONFIDENCE_SCORES)}, "
                                   f"got {self.score!r}")


SamplerOptions = ConfidenceOptions | RemaskOptions | ThresholdOptions
# Which samplers take options, and of what type.
OPTIONS_TYPES: dict[str, type] = {"confidence": ConfidenceOptions, "remdm": RemaskOptions,
                                  "threshold": ThresholdOptions}


@dataclass(frozen=True)
class SamplingPlan:
    """How to sample; see the module docstring. Invalid values raise ``PlanError``."""

    sampler: str = "ancestral"
    steps: int | None = None            # network-call budget per sequence (per block); None: the sampler's
    grid: str = "uniform"               # time grid of the step-based samplers (GRIDS)
    top_p: float | None = None          # nucleus; None: the full distribution
    temperature: float = 1.0            # softmax(logits / temperature)
    seed: int = 0                       # the samples' generators (``sample_generators``)
    block_len: int | None = None        # semi-autoregressive blocks of this many tokens
    options: SamplerOptions | None = field(default=None)  # None: the sampler's defaults
    cache: bool = True                  # skip calls whose output nobody needs
    static_shape: bool = False          # every row, every position through each call
    compile: str = "auto"               # COMPILE_SETTINGS: torch.compile the network's blocks
    until_eos: int | None = None        # block diffusion: a sample stops after this token id (its EOS)
    prefix_cache: int | None = None     # blocks: the context's keys and values, recomputed every N calls
    guidance: float | None = None       # unsupervised classifier-free guidance weight w (two passes a call)
    whole_sequence: bool = False        # blocks: every call sees the whole sequence, the masked suffix too
    dual_cache: int | None = None       # whole_sequence: the prefix's and suffix's keys and values, every N calls

    RECORDED: ClassVar[tuple[str, ...]] = ("sampler", "steps", "grid", "top_p", "temperature", "seed",
                                           "block_len", "options", "cache", "static_shape", "compile")
    # Recorded only when set, so that the records of plans without them do not change.
    RECORDED_WHEN_SET: ClassVar[tuple[str, ...]] = ("until_eos", "prefix_cache", "guidance", "whole_sequence",
                                                    "dual_cache")

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            _fail("sampler", f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.steps is None and self.sampler not in UNBUDGETED:
            object.__setattr__(self, "steps", DEFAULT_STEPS)
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(self.steps, int)
                                       or self.steps < 1):
            _fail("steps", f"steps must be an integer >= 1, got {self.steps!r}")
        if self.steps is not None and self.steps > MAX_STEPS:
            _fail("steps", f"steps {self.steps:,} is more than MAX_STEPS = {MAX_STEPS:,}: every step costs host work "
                           f"whether or not it calls the network (model.sampling.plan); for the continuous-time "
                           f"limit of the absorbing process use the first-hitting sampler")
        if self.grid not in GRIDS:
            _fail("grid", f"grid must be one of {', '.join(GRIDS)}, got {self.grid!r}")
        if self.sampler in UNBUDGETED and self.grid != "uniform":
            why = "its event times are exact" if self.sampler == "first-hitting" else "confidence sets its pace"
            _fail("grid", f"the {self.sampler} sampler has no time grid ({why}): leave the grid at uniform, "
                          f"got {self.grid!r}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"top_p must lie in (0, 1], got {self.top_p}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            _fail("temperature", f"temperature must be a number > 0, got {self.temperature!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            _fail("seed", f"seed must be an integer >= 0, got {self.seed!r}")
        if self.block_len is not None and (isinstance(self.block_len, bool) or not isinstance(self.block_len, int)
                                           or self.block_len < 1):
            _fail("block_len", f"block_len must be an integer >= 1, got {self.block_len!r}")
        if self.until_eos is not None and (isinstance(self.until_eos, bool) or not isinstance(self.until_eos, int)
                                           or self.until_eos < 0):
            _fail("until_eos", f"until_eos must be a token id >= 0, got {self.until_eos!r}")
        if self.compile not in COMPILE_SETTINGS:
            _fail("compile", f"compile must be one of {', '.join(COMPILE_SETTINGS)}, got {self.compile!r}")
        self._check_fast_generation()
        self._resolve_options()

    def _check_fast_generation(self) -> None:
        """``prefix_cache``, ``guidance``, ``whole_sequence`` and ``dual_cache`` (docs/fast-generation.md)."""
        if self.prefix_cache is not None:
            if isinstance(self.prefix_cache, bool) or not isinstance(self.prefix_cache, int) or self.prefix_cache < 1:
                _fail("prefix_cache", f"prefix_cache is the refresh interval in network calls, an integer >= 1, "
                                      f"got {self.prefix_cache!r}")
            if self.block_len is None:
                _fail("prefix_cache", "prefix_cache caches the finished blocks' keys and values: it needs "
                                      "semi-autoregressive blocks (block_len)")
            if self.static_shape:
                _fail("prefix_cache", "prefix_cache runs the block's rows alone between refreshes, static_shape every "
                                      "position: leave one of them out")
        if self.guidance is not None and not (isinstance(self.guidance, (int, float))
                                              and not isinstance(self.guidance, bool)
                                              and math.isfinite(self.guidance) and self.guidance >= 0):
            _fail("guidance", f"guidance must be a number >= 0, got {self.guidance!r}")
        self._check_whole_sequence()

    def _check_whole_sequence(self) -> None:
        if not isinstance(self.whole_sequence, bool):
            _fail("whole_sequence", f"whole_sequence is true or false, got {self.whole_sequence!r}")
        if self.whole_sequence and self.block_len is None:
            _fail("whole_sequence", "whole_sequence shows semi-autoregressive blocks the whole sequence: it needs "
                                    "blocks (block_len)")
        if self.dual_cache is None:
            return
        if isinstance(self.dual_cache, bool) or not isinstance(self.dual_cache, int) or self.dual_cache < 1:
            _fail("dual_cache", f"dual_cache is the refresh interval in network calls, an integer >= 1, "
                                f"got {self.dual_cache!r}")
        if not self.whole_sequence:
            _fail("dual_cache", "dual_cache caches the keys and values of the prefix and of the masked suffix: it "
                                "needs whole_sequence blocks")
        if self.prefix_cache is not None:
            _fail("dual_cache", "dual_cache holds the prefix's keys and values already: leave one of dual_cache and "
                                "prefix_cache out")
        if self.static_shape:
            _fail("dual_cache", "dual_cache runs the block's rows alone between refreshes, static_shape every "
                                "position: leave one of them out")

    def _resolve_options(self) -> None:
        expected = OPTIONS_TYPES.get(self.sampler)
        if expected is None:
            if self.options is not None:
                _fail("options", f"the {self.sampler} sampler takes no options, got {self.options!r}")
            return
        if self.options is None:
            object.__setattr__(self, "options", expected())
        elif not isinstance(self.options, expected):
            _fail("options", f"the {self.sampler} sampler takes {expected.__name__}, got {self.options!r}")

    # ------------------------------------------------------------------ records
    def to_dict(self) -> dict[str, Any]:
        """The plan as a JSON object (``from_dict`` reads it back)."""
        record = {name: getattr(self, name) for name in self.RECORDED}
        record["options"] = dataclasses.asdict(self.options) if self.options is not None else None
        record.update({name: getattr(self, name) for name in self.RECORDED_WHEN_SET
                       if getattr(self, name) is not None and getattr(self, name) is not False})
        return record

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> SamplingPlan:
        """A plan from ``to_dict``'s object; PlanError when it is not a valid plan."""
        unknown = set(record) - set(cls.RECORDED) - set(cls.RECORDED_WHEN_SET)
        if unknown:
            _fail(min(unknown), f"a sampling plan has no field {min(unknown)!r}")
        values = dict(record)
        sampler = values.get("sampler", "ancestral")
        options = values.pop("options", None)
        if options is not None:
            values["options"] = _options_from_record(sampler, options)
        return cls(**values)

    def describe(self) -> str:
        """One line for people: the sampler, its budget and what shapes the distribution."""
        exact = "(exact)" if self.sampler == "first-hitting" else "(at most)"
        budget = (f"one network call per generated token {exact}" if self.steps is None
                  else f"{self.steps:,} steps" if self.sampler not in UNBUDGETED
                  else f"a budget of {self.steps:,} network calls")
        parts = [f"{self.sampler} sampler, {budget}"]
        if self.sampler in ("ancestral", "confidence", "remdm"):
            parts.append(f"{self.grid} grid")
        if self.options is not None:
            parts.append(", ".join(f"{key} {value}" for key, value in dataclasses.asdict(self.options).items()
                                   if not (self.sampler == "remdm" and key in ("t_on", "t_off", "alpha_on")
                                           and self.options.schedule != "loop")))
        parts.append(f"temperature {self.temperature:g}")
        parts.append(f"top-p {self.top_p:g}" if self.top_p is not None else "full distribution")
        if self.block_len is not None:
            parts.append(f"blocks of {self.block_len:,} tokens")
        if self.until_eos is not None:
            parts.append(f"until EOS (id {self.until_eos})")
        if self.prefix_cache is not None:
            parts.append(f"prefix cache refreshed every {self.prefix_cache} calls (approximate)")
        if self.whole_sequence:
            parts.append("each call sees the whole sequence")
        if self.dual_cache is not None:
            parts.append(f"dual cache refreshed every {self.dual_cache} calls (approximate)")
        if self.guidance is not None:
            parts.append(f"guidance {self.guidance:g} (two passes a call)")
        parts.append(f"seed {self.seed}")
        return "; ".join(parts)


def check_budget(plan: SamplingPlan, seq_len: int) -> None:
    """PlanError (field ``seq_len`` or ``steps``) when sequences of ``seq_len`` tokens, sampled as
    ``plan`` says, pass ``MAX_SAMPLE_LEN`` or ``MAX_STEPS_PER_POSITION`` (docs/sampling.md#the-budget)."""
    if seq_len > MAX_SAMPLE_LEN:
        _fail("seq_len", f"a sample of {seq_len:,} tokens is longer than MAX_SAMPLE_LEN = {MAX_SAMPLE_LEN:,}: "
                         f"a sample is held whole and decoded and scored as one text")
    if plan.steps is None or plan.sampler in UNBUDGETED:  # no grid: calls are at most one per token
        return
    positions = min(seq_len, plan.block_len or seq_len)
    limit = MAX_STEPS_PER_POSITION * positions
    if plan.steps > limit:
        where = "block" if plan.block_len is not None and plan.block_len < seq_len else "sequence"
        _fail("steps", f"steps {plan.steps:,} is more than MAX_STEPS_PER_POSITION = {MAX_STEPS_PER_POSITION:,} per "
                       f"position of a {where} of {positions:,} (at most {limit:,}): past it the samples barely "
                       f"change while every step costs host work (model.sampling.plan)")


def _options_from_record(sampler: str, record: dict[str, Any]) -> SamplerOptions:
    options_type = OPTIONS_TYPES.get(sampler)
    if options_type is None:
        _fail("options", f"the {sampler} sampler takes no options, got {record!r}")
    names = {f.name for f in dataclasses.fields(options_type)}
    unknown = sorted(set(record) - names)
    if unknown:
        _fail(f"options.{unknown[0]}", f"the {sampler} sampler has no option {unknown[0]!r} "
                                       f"(its options: {', '.join(sorted(names))})")
    return options_type(**record)


def parse_sampler_options(sampler: str, pairs: list[str]) -> SamplerOptions | None:
    """``["KEY=VALUE", ...]`` (a command line's) as the options of ``sampler``, typed by its
    options class; PlanError naming the option when a key or a value is bad."""
    if not pairs:
        return None
    options_type = OPTIONS_TYPES.get(sampler)
    if options_type is None:
        _fail("options", f"the {sampler} sampler takes no options, got {', '.join(pairs)}")
    kinds = {f.name: f.type for f in dataclasses.fields(options_type)}
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in kinds:
            _fail("options", f"sampler option {pair!r}: write KEY=VALUE with KEY one of "
                             f"{', '.join(sorted(kinds))} (the {sampler} sampler's options)")
        if key in values:
            _fail(f"options.{key}", f"sampler option {key} is given twice ({values[key]}, then {text.strip()}): "
                                    f"give it once")
        values[key] = _typed(key, text.strip(), kinds[key])
    unread = [key for key in LOOP_OPTIONS if key in values and values.get("schedule", "cap") != "loop"]
    if sampler == "remdm" and unread:
        _fail(f"options.{unread[0]}", f"sampler option {unread[0]} is the loop schedule's: the "
                                      f"{values.get('schedule', 'cap')} schedule does not read it "
                                      f"(add schedule=loop, or leave it out)")
    return _options_from_record(sampler, values)


def _typed(key: str, text: str, kind: str) -> Any:
    """``text`` as the option's type (annotations are strings here: ``str``, ``float``, ``int``)."""
    if "float" not in kind and "int" not in kind:
        return text
    if "None" in kind and text.lower() == "none":
        return None
    try:
        return float(text) if "float" in kind else int(text)
    except ValueError:
        what = "a number" if "float" in kind else "an integer"
        _fail(f"options.{key}", f"sampler option {key} must be {what}, got {text!r}")
