"""The ``unmask`` model of lm-evaluation-harness: an unmask export (diffusion, absorbing, uniform
or learned, or autoregressive) scored as lm-eval scores every language model.

    import lm_eval
    from evaluation.downstream.lm_eval_model import UnmaskLM          # importing registers the model "unmask"
    results = lm_eval.simple_evaluate(model="unmask", model_args="path=runs/tiny,samples=32",
                                      tasks=["lambada_openai"])
    results = lm_eval.simple_evaluate(model=UnmaskLM("runs/tiny"), tasks=["hellaswag"])

``python -m evaluation.downstream.lm_eval_model`` is lm-eval's own command line with this model
registered (lm-eval 0.4 finds models only in its own registry); ``unmask lm-eval``
(``evaluation.downstream.run``) runs the same harness and adds the report and MLflow. The
requests are answered by ``evaluation.downstream.likelihoods`` (``loglikelihood``,
``loglikelihood_rolling``) and ``evaluation.generation.generate.continue_tokens``
(``generate_until``: request i of a call is sample i of the seed, whatever the others); with the
model argument ``guidance`` w, ``loglikelihood`` scores by guided logits (a ranking of the choices,
not a likelihood bound, docs/fast-generation.md#guided-loglikelihood). A model argument it does
not know is refused in one line. The arguments and what each request means:
docs/downstream.md#lm-evals-own-command-line-and-python-api.
"""

from __future__ import annotations

import difflib
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from common.errors import UserError
from common.progress import bar as progress_bar
from evaluation.downstream.likelihoods import (
    GUIDED_SCORES,
    Score,
    ScoringModel,
    ScoringSettings,
    check_guidance,
    score_continuations,
    score_documents,
)
from evaluation.generation.generate import continue_tokens
from evaluation.inference import inference_mode, resolve_device
from model.sampling import PlanError, SamplingPlan, check_budget
from model.sampling.plan import UNBUDGETED
from pipeline.interchange.export import Exported, load_export
from pipeline.interchange.run_export import choose_export

__all__ = ["MODEL_NAME", "RequestRecord", "UnmaskLM", "sample_continuation"]

log = logging.getLogger("unmask.lm_eval")

MODEL_NAME = "unmask"
AUTO = "auto"
DEFAULT_MAX_GEN_TOKS = 256   # lm-eval's HFLM default
# A nucleus this small keeps only the most likely token (model.sampling.top_p_filter keeps the
# top one always): lm-eval's greedy decoding (do_sample false) through the samplers' top_p.
GREEDY_TOP_P = 1e-9
DEFAULT_TEMPERATURE = 1.0    # lm-eval's do_sample without a temperature
MODEL_ARGUMENTS = ("path", "samples", "seed", "batch_size", "max_batch_size", "device", "gen_sampler", "gen_steps",
                   "gen_grid", "gen_guidance", "gen_block_len", "gen_whole_sequence", "gen_dual_cache", "guidance")
# The plan's fields as model arguments.
GENERATION_ARGUMENTS = {"sampler": "gen_sampler", "steps": "gen_steps", "grid": "gen_grid", "guidance": "gen_guidance",
                        "block_len": "gen_block_len", "whole_sequence": "gen_whole_sequence",
                        "dual_cache": "gen_dual_cache"}


@dataclass(frozen=True)
class RequestRecord:
    """One scored request: its task, its kind (``loglikelihood`` or ``loglikelihood_rolling``)
    and its ``Score`` (with the replicates its task's Monte Carlo error is made from)."""

    task: str
    kind: str
    score: Score


@dataclass(frozen=True)
class Generation:
    """How ``generate_until`` samples (the model arguments ``gen_sampler``, ``gen_steps``, ``gen_grid``,
    ``gen_guidance``: unsupervised classifier-free guidance towards the context; ``gen_block_len``,
    ``gen_whole_sequence``, ``gen_dual_cache``: semi-autoregressive blocks, docs/fast-generation.md)."""

    sampler: str = "ancestral"
    steps: int | None = None       # the budget of a diffusion sample (per block); None: one call per generated token
    grid: str = "uniform"
    guidance: float | None = None
    block_len: int | None = None
    whole_sequence: bool = False
    dual_cache: int | None = None

    def plan(self, new_tokens: int, *, top_p: float | None, temperature: float, seed: int) -> SamplingPlan:
        """The plan of one request of ``new_tokens`` tokens."""
        per_block = new_tokens if self.block_len is None else min(new_tokens, self.block_len)
        steps = self.steps if self.steps is not None or self.sampler in UNBUDGETED else per_block
        return SamplingPlan(sampler=self.sampler, steps=steps, grid=self.grid, top_p=top_p, temperature=temperature,
                            seed=seed, guidance=self.guidance, block_len=self.block_len,
                            whole_sequence=self.whole_sequence, dual_cache=self.dual_cache)


@register_model(MODEL_NAME)
class UnmaskLM(TemplateLM):
    """An unmask export as an lm-eval model; see the module docstring."""

    def __init__(self, path: str | Path | None = None, samples: int = 16, seed: int = 0, batch_size: int | str = AUTO,
                 max_batch_size: int | None = None, device: str | None = None, gen_sampler: str = "ancestral",
                 gen_steps: int | None = None, gen_grid: str = "uniform", gen_guidance: float | None = None,
                 gen_block_len: int | None = None, gen_whole_sequence: bool | str = False,
                 gen_dual_cache: int | None = None, guidance: float | None = None, **unknown: Any) -> None:
        super().__init__()
        if unknown:
            raise UserError(f"model argument {', '.join(map(repr, unknown))} is not one of the unmask model's: "
                            f"{', '.join(MODEL_ARGUMENTS)}{_suggestion(unknown)}")
        if path is None:
            raise UserError("model argument path is required: path=RUN_OR_EXPORT")
        self.settings = _settings(samples, seed, batch_size, max_batch_size)
        self.generation = _generation(Generation(gen_sampler, gen_steps, gen_grid, gen_guidance, gen_block_len,
                                                 gen_whole_sequence, gen_dual_cache))
        self._device = _device(device)
        self.export_dir = choose_export(path)  # a run: its latest checkpoint's export
        self.exported: Exported = load_export(self.export_dir)
        _check_sampler(self.exported, self.generation)
        self.model = ScoringModel.of(self.exported, self._device)
        self.guidance = _guidance(guidance, self.model)   # loglikelihood's, None: the conditional bound
        self.records: list[RequestRecord] = []
        self.truncated_contexts = 0   # requests whose context lost tokens on the left

    # ------------------------------------------------------------------ TemplateLM's hooks
    @property
    def eot_token_id(self) -> int:
        return self.exported.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self.model.max_seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The ids of ``string`` under the model's tokenizer, no special tokens added."""
        return self.exported.tokenizer.encode(string)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        scores = self._score_pairs([(context, continuation) for _, context, continuation in requests])
        return [(score.log_likelihood, score.is_greedy) for score in scores]

    # ------------------------------------------------------------------ the requests
    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's ``loglikelihood``: per request, the conditional ELBO of the continuation given the
        context (with ``guidance``, the guided score), and whether the continuation is the greedy answer."""
        pairs = [self._encode(*request.args) for request in requests]
        for request, (_, continuation) in zip(requests, pairs):
            if len(continuation) > self.model.max_seq_len:
                raise UserError(f"task {request.task_name}, document {request.doc_id}: a continuation of "
                                f"{len(continuation)} tokens exceeds the model's max_seq_len {self.model.max_seq_len} "
                                f"(it cannot be scored in one row; lm-eval's Hugging Face model refuses it too)")
        scores = self._score_pairs(pairs)
        kind = "loglikelihood" if self.guidance is None else "loglikelihood (guided)"
        self.records += [RequestRecord(request.task_name, kind, score) for request, score in zip(requests, scores)]
        return [(score.log_likelihood, score.is_greedy) for score in scores]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """lm-eval's ``loglikelihood_rolling``: per document, minus ``unmask eval``'s bound on its
        tokens and an EOS."""
        tokenizer = self.exported.tokenizer
        documents = [self.tok_encode(request.args[0]) for request in requests]
        pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        scores = score_documents(self.model, documents, self.settings, eos_id=tokenizer.eos_id, pad_id=pad)
        self.records += [RequestRecord(request.task_name, "loglikelihood_rolling", score)
                         for request, score in zip(requests, scores)]
        return [score.log_likelihood for score in scores]

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """lm-eval's ``generate_until``: per request, a continuation sampled with the context as
        prompt, cut at the first stop sequence."""
        with progress_bar(requests, desc="generate_until", unit="request", disable=disable_tqdm) as bar:
            return [self._generate(context, gen_kwargs, index) for index, (context, gen_kwargs) in
                    enumerate(request.args for request in bar)]

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records under ``config`` in its results."""
        config = self.exported.config
        guided = ({} if self.guidance is None
                  else {"unmask_guidance": self.guidance, "unmask_loglikelihood": GUIDED_SCORES})
        return {"unmask_export": str(self.export_dir.resolve()), "unmask_step": config.get("step"),
                "unmask_objective": config.get("objective"), "unmask_process": self.exported.spec.process,
                "unmask_samples": self.settings.samples, "unmask_seed": self.settings.seed, **guided}

    # ------------------------------------------------------------------ helpers
    def _encode(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """As ``TemplateLM.loglikelihood`` encodes a request: an empty context is the prefix token."""
        if context:
            return self._encode_pair(context, continuation)
        continuation_ids = self.tok_encode(continuation)
        if continuation_ids and continuation_ids[0] == self.prefix_token_id:
            return continuation_ids[:1], continuation_ids[1:]
        return [self.prefix_token_id], continuation_ids

    def _score_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> list[Score]:
        scores = score_continuations(self.model, pairs, self.settings, guidance=self.guidance)
        truncated = sum(score.context_dropped > 0 for score in scores)
        if truncated:
            log.info("%d of %d requests had their context cut from the left to fit max_seq_len %d",
                     truncated, len(scores), self.model.max_seq_len)
        self.truncated_contexts += truncated
        return scores

    def _generate(self, context: str, gen_kwargs: dict, index: int) -> str:
        tokenizer = self.exported.tokenizer
        kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
        new_tokens = kwargs.pop("max_gen_toks")
        if not 0 < new_tokens < self.model.max_seq_len:
            raise UserError(f"generate_until asks for max_gen_toks {new_tokens}: it must lie in [1, "
                            f"{self.model.max_seq_len - 1}] for this model (max_seq_len {self.model.max_seq_len})")
        top_p, temperature = _token_distribution(kwargs)
        plan = self.generation.plan(new_tokens, top_p=top_p, temperature=temperature, seed=self.settings.seed)
        try:
            check_budget(plan, new_tokens)
        except PlanError as err:
            raise UserError(f"model argument gen_steps: {err} (this task generates {new_tokens} tokens)") from None
        prompt = self.tok_encode(context)[-(self.model.max_seq_len - new_tokens):] if context else []
        tokens = sample_continuation(self.exported, self.model, prompt, new_tokens, plan=plan, index=index)
        if tokenizer.eos_id in tokens:
            tokens = tokens[:tokens.index(tokenizer.eos_id)]
        return postprocess_generated_text(tokenizer.decode(tokens), until, None)


# ------------------------------------------------------------------------------ sampling
def sample_continuation(exported: Exported, model: ScoringModel, prompt: Sequence[int], new_tokens: int, *,
                        plan: SamplingPlan, index: int = 0) -> list[int]:
    """``new_tokens`` ids sampled after ``prompt`` (kept as it is) as ``plan`` says, by the
    generator of sample ``index`` of its seed: the one place lm-eval's requests reach the
    samplers (``evaluation.generation.generate.continue_tokens``; autoregressive exports left to right)."""
    with inference_mode(model.network, model.device):
        sample, = continue_tokens(exported, plan, [list(prompt)], max_new_tokens=new_tokens, indices=[index],
                                  device=str(model.device))
    return sample.tokens[len(prompt):]


# ------------------------------------------------------------------------------ arguments
def _integer(name: str, value: Any, minimum: int) -> int:
    """A model argument that must be an integer (lm-eval parses ``k=v`` strings into numbers)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"model argument {name}={value!r}: must be an integer >= {minimum}")
    return value


def _suggestion(unknown: dict[str, Any]) -> str:
    close = [match for name in unknown for match in difflib.get_close_matches(name, MODEL_ARGUMENTS, n=1)]
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _settings(samples: Any, seed: Any, batch_size: Any, max_batch_size: Any) -> ScoringSettings:
    """lm-eval's ``batch_size`` counts rows per forward pass here; ``auto`` (also ``auto:N``)
    sizes them by the device's capacity, at most ``max_batch_size``."""
    automatic = batch_size is None or str(batch_size).startswith(AUTO)
    return ScoringSettings(samples=_integer("samples", samples, 1), seed=_integer("seed", seed, 0),
                           batch_rows=None if automatic else _integer("batch_size", batch_size, 1),
                           max_batch_rows=None if max_batch_size is None else _integer("max_batch_size",
                                                                                        max_batch_size, 1))


def _device(name: str | None) -> torch.device:
    """``name``, or a GPU when there is one. lm-eval's command line passes ``cuda:0`` unless told
    otherwise: without CUDA that falls back to the CPU (a name of another kind must exist)."""
    if name is not None and name.startswith("cuda") and not torch.cuda.is_available():
        log.info("device %s is not available: scoring on the CPU", name)
        name = None
    return resolve_device(name)


def _generation(given: Generation) -> Generation:
    """The generation arguments as lm-eval passes them (numbers, or strings), typed and checked as a
    plan checks them (one line naming the argument)."""
    guidance = given.guidance
    if guidance is not None:
        try:
            guidance = float(guidance)
        except ValueError:
            raise UserError(f"model argument gen_guidance must be a number >= 0, got {guidance!r}") from None
    whole = given.whole_sequence
    if isinstance(whole, str) and whole.strip().lower() in ("true", "false"):
        whole = whole.strip().lower() == "true"
    if not isinstance(whole, bool):
        raise UserError(f"model argument gen_whole_sequence must be true or false, got {whole!r}")
    optional = {name: None if getattr(given, name) is None else _integer(GENERATION_ARGUMENTS[name],
                                                                          getattr(given, name), 1)
                for name in ("steps", "block_len", "dual_cache")}
    generation = replace(given, guidance=guidance, whole_sequence=whole, **optional)
    try:
        generation.plan(1, top_p=None, temperature=DEFAULT_TEMPERATURE, seed=0)
    except PlanError as err:
        raise UserError(f"model argument {GENERATION_ARGUMENTS.get(err.field, err.field)}: {err}") from None
    return generation


def _guidance(value: Any, model: ScoringModel) -> float | None:
    """The model argument ``guidance`` (lm-eval passes numbers or strings), for ``model``."""
    if value is None:
        return None
    try:
        weight = float(value)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and weight >= 0):
        raise UserError(f"model argument guidance must be a number >= 0, got {value!r}")
    try:
        check_guidance(model)
    except ValueError as err:
        raise UserError(f"model argument guidance: {err}") from None
    return weight


def _check_sampler(exported: Exported, generation: Generation) -> None:
    """The export's process must take ``gen_sampler`` (an autoregressive one: ancestral only), and
    ``gen_guidance`` a diffusion export that samples the whole sequence (not block diffusion)."""
    sampler = generation.sampler
    if generation.guidance is not None and (exported.config.get("objective") != "diffusion"
                                            or exported.spec.block_size is not None):
        raise UserError("model argument gen_guidance: guidance masks the context in a second pass, which needs a "
                        "diffusion export that samples the whole sequence (not autoregressive, not block diffusion)")
    if exported.config.get("objective") != "diffusion":
        if sampler != "ancestral":
            raise UserError(f"model argument gen_sampler={sampler}: an autoregressive export samples left to "
                            f"right (ancestral, the default)")
        return
    try:
        process = exported.process(validate=False)
        process.sampler(sampler)
    except ValueError as err:
        raise UserError(f"model argument gen_sampler={sampler}: {err}") from None
    if generation.whole_sequence and (exported.spec.block_size is not None or not hasattr(process, "mask_id")):
        raise UserError("model argument gen_whole_sequence: the network sees the suffix masked, which needs an "
                        "absorbing export that is not block diffusion")


def _token_distribution(kwargs: dict) -> tuple[float | None, float]:
    """The samplers' (top_p, temperature) for lm-eval's normalized generation kwargs: greedy (the
    smallest nucleus) without do_sample or at temperature 0, else the task's temperature and top_p."""
    temperature = float(kwargs.get("temperature", DEFAULT_TEMPERATURE))
    if not kwargs.get("do_sample") or temperature <= 0:
        return GREEDY_TOP_P, DEFAULT_TEMPERATURE
    top_p = kwargs.get("top_p")
    return (None if top_p is None else float(top_p)), temperature


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the ``unmask`` model registered (module docstring); a
    mistake the user can fix is one line on stderr."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except UserError as err:
        print(f"lm-eval (unmask): error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
