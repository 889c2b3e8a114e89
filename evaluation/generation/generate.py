"""Text generation from an export, unconditionally, after a prompt, or by infilling: the library
behind ``unmask sample``, what ``unmask eval`` samples for its report, and what lm-eval calls.

    exported = load_export(resolve_export(Path("runs/tiny")))
    plan = SamplingPlan(sampler="first-hitting", top_p=0.9, seed=1)
    samples = generate(exported, plan, num=4, prompt="Once upon a time")
    print(samples[0].text, samples[0].network_calls)
    answers = complete(exported, plan, ["Q: 2 + 2 =", "ROMEO:"], max_new_tokens=16)  # one per prompt

Invariants: sample i draws from its own generator, seeded by (the plan's seed, i), so the same
export, plan and arguments give the same samples whatever ``batch_size`` (``complete``'s answer
to prompt i is ``generate``'s sample i of that prompt); ``Sample.text`` decodes up to the first
EOS after the last kept token; ``Sample.network_calls`` counts the network evaluations that
sample needed. Bad arguments raise ``UserError`` naming the flag of ``unmask sample``;
``check_plan`` checks a plan against an export before any work. Samplers, budgets, prompts,
templates and blocks: docs/sampling.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from common.errors import UserError
from common.progress import bar as progress_bar
from data_prep.tokenizer.base import Tokenizer
from evaluation.inference import BLOCKS_UNCOMPILED, inference_mode, resolve_device, should_compile
from model.block_attention import AttentionLayout, KVCache
from model.documents import masks_documents

# The diffusion sampler's float64 inverse-CDF draw: the AR sampler draws its tokens the same way.
from model.sampling import (
    PlanError,
    SamplingPlan,
    check_budget,
    inverse_cdf,
    reverse_sample,
    row_uniforms,
    sample_generators,
    token_probs,
)
from model.spec import PROCESS_TYPES
from pipeline.interchange.export import Exported

__all__ = ["DEFAULT_BATCH_SIZE", "INFILL_PLACEHOLDER", "INFILL_SYNTAX", "Sample", "autoregressive_sample", "build_prompt",
           "check_plan", "check_sampling", "complete", "continue_tokens", "generate", "resolve_device"]

# An infill placeholder: "[MASK]" is one generated token, "[MASK*n]" n of them (n >= 1).
INFILL_PLACEHOLDER = re.compile(r"\[MASK(?:\*(\d+))?\]")
INFILL_SYNTAX = "[MASK] for one generated token, [MASK*n] for n of them"
# Anything starting like a placeholder that the pattern above did not consume is a typo.
_PLACEHOLDER_START = "[MASK"

DIFFUSION, AUTOREGRESSIVE = "diffusion", "autoregressive"
DEFAULT_BATCH_SIZE = 8


@dataclass(frozen=True)
class Sample:
    """One generated sequence; see the module docstring for ``text`` and ``network_calls``."""

    text: str                # decoded up to the first EOS after the last kept token
    tokens: list[int]        # the whole sequence, seq_len ids
    text_tokens: int         # how many leading ids of ``tokens`` ``text`` decodes
    network_calls: int       # network evaluations this sequence needed
    prompt: str | None       # the prompt text or the infill template
    plan: SamplingPlan       # how it was drawn
    index: int               # its number under the plan's seed (sample i is the same in any batch)

    def to_dict(self) -> dict:
        """The sample as a JSON object (a line of ``unmask sample --out``)."""
        return {"text": self.text, "tokens": self.tokens, "text_tokens": self.text_tokens,
                "network_calls": self.network_calls, "prompt": self.prompt, "index": self.index,
                "plan": self.plan.to_dict()}


# ------------------------------------------------------------------ conditioning
def build_prompt(tokenizer: Tokenizer, seq_len: int, mask_id: int, *, prompt: str | None = None,
                 infill: str | None = None) -> torch.LongTensor | None:
    """The sampler's conditioning, LongTensor [seq_len]: kept tokens, ``mask_id`` where to generate.

    ``prompt``: its tokens at the start, the rest masked. ``infill``: a template (see
    ``INFILL_SYNTAX``) whose literal segments are tokenized separately and kept in place;
    positions after the template are masked too. None when neither is given.
    """
    if prompt is not None and infill is not None:
        raise UserError("--prompt and --infill are exclusive: give one of them")
    if prompt is not None:
        layout, flag, what = [tokenizer.encode(prompt)], "--prompt", "tokens"
    elif infill is not None:
        layout, flag = _template_layout(tokenizer, infill), "--infill"
        what = "tokens (literal text plus masked spans)"
    else:
        return None
    length = sum(_span_length(span) for span in layout)
    if length > seq_len:
        raise UserError(f"{flag} is {length} {what}, longer than --seq-len {seq_len}")
    if length == seq_len and all(isinstance(span, list) for span in layout):
        raise UserError(f"{flag} fills all {seq_len} positions of --seq-len: nothing is left to generate")
    conditioning = torch.full((seq_len,), mask_id, dtype=torch.long)
    position = 0
    for span in layout:
        if isinstance(span, list):  # kept tokens; an int is a run of masks, already in place
            conditioning[position:position + len(span)] = torch.tensor(span, dtype=torch.long)
        position += _span_length(span)
    return conditioning


# A template's layout: kept token lists and masked-span lengths, in order. Spans stay counts
# until the length is checked, so "[MASK*10000000000]" is refused rather than allocated.
Layout = list[list[int] | int]


def _span_length(span: list[int] | int) -> int:
    return len(span) if isinstance(span, list) else span


def _template_layout(tokenizer: Tokenizer, template: str) -> Layout:
    """The template's literal segments, each encoded, and its placeholders' span lengths."""
    layout: Layout = []
    position = 0
    for match in INFILL_PLACEHOLDER.finditer(template):
        layout.append(_literal_tokens(tokenizer, template[position:match.start()]))
        count = int(match.group(1)) if match.group(1) is not None else 1
        if count < 1:
            raise UserError(f"--infill placeholder {match.group(0)!r}: a span needs at least one token "
                            f"({INFILL_SYNTAX})")
        layout.append(count)
        position = match.end()
    layout.append(_literal_tokens(tokenizer, template[position:]))
    return layout


def _literal_tokens(tokenizer: Tokenizer, segment: str) -> list[int]:
    at = segment.find(_PLACEHOLDER_START)
    if at >= 0:
        shown = segment[at:at + len(_PLACEHOLDER_START) + 8]
        raise UserError(f"--infill has a malformed placeholder near {shown!r}: write {INFILL_SYNTAX}")
    # Segments are encoded apart, so no token straddles a kept/generated boundary.
    return tokenizer.encode(segment) if segment else []


# ------------------------------------------------------------------ generation
@dataclass(frozen=True)
class _Batch:
    """Samples drawn together: their numbers under the plan's seed, what they start from
    (diffusion: [rows, seq_len] kept tokens and ``generate_id``; autoregressive: the
    [rows, P] prefix) and the prompt text each records."""

    indices: list[int]
    conditioning: Tensor
    shown: list[str | None]
    seq_len: int


def generate(exported: Exported, plan: SamplingPlan, *, num: int, seq_len: int | None = None,
             prompt: str | None = None, infill: str | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
             device: str | None = None) -> list[Sample]:
    """Draw ``num`` samples (numbered 0 to num - 1) from ``exported`` as ``plan`` says, all with
    the same ``prompt`` or ``infill`` template (docs/sampling.md).

    ``seq_len`` defaults to the network's ``max_seq_len``; longer needs ``plan.block_len``.
    Bad arguments raise ``UserError`` naming the CLI flag.
    """
    seq_len = exported.network.config.max_seq_len if seq_len is None else seq_len
    _check_positive("--num", num)
    if plan.guidance is not None and prompt is None and infill is None:
        raise UserError("--guidance guides generation towards a --prompt or --infill template (its second pass masks "
                        "them): give one, or leave --guidance out")
    _check_positive("--batch-size", batch_size)
    objective = check_plan(exported, plan, seq_len=seq_len, infill=infill)
    if objective == AUTOREGRESSIVE:
        conditioning = torch.tensor(_autoregressive_prefix(exported.tokenizer, prompt, seq_len), dtype=torch.long)
    else:
        generate_id = exported.process(validate=False).generate_id
        conditioning = build_prompt(exported.tokenizer, seq_len, generate_id, prompt=prompt, infill=infill)
        conditioning = torch.full((seq_len,), generate_id) if conditioning is None else conditioning
    shown = prompt if infill is None else infill
    batches = [_Batch(list(range(first, first + rows)), conditioning.expand(rows, -1), [shown] * rows, seq_len)
               for first in range(0, num, batch_size) for rows in [min(batch_size, num - first)]]
    return _draw(exported, plan, batches, objective, device)


def complete(exported: Exported, plan: SamplingPlan, prompts: Sequence[str], *, max_new_tokens: int,
             batch_size: int = DEFAULT_BATCH_SIZE, device: str | None = None) -> list[Sample]:
    """One continuation of ``max_new_tokens`` tokens per prompt, in the order of ``prompts``:
    what an evaluation harness's ``generate_until`` asks for (``continue_tokens`` with the
    prompts encoded, numbered 0, 1, ...).

    Sample i continues ``prompts[i]`` and is drawn by generator i of the plan's seed, so it
    does not depend on the other prompts nor on ``batch_size``. ``Sample.text`` is the prompt
    and its continuation up to the first EOS after the prompt; a harness cuts it at its own
    stop strings.
    """
    encoded = [exported.tokenizer.encode(text) for text in prompts]
    return continue_tokens(exported, plan, encoded, max_new_tokens=max_new_tokens, shown=list(prompts),
                           batch_size=batch_size, device=device)


def continue_tokens(exported: Exported, plan: SamplingPlan, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    indices: Sequence[int] | None = None, shown: Sequence[str | None] | None = None,
                    batch_size: int = DEFAULT_BATCH_SIZE, device: str | None = None) -> list[Sample]:
    """``max_new_tokens`` ids after each prompt of token ids, kept as they are, in the order given.

    ``indices``: each prompt's sample number under the plan's seed (default 0, 1, ...): its
    generator, so a continuation is the same alone or among others. ``shown``: the text each
    ``Sample.prompt`` records. Prompts of one length are drawn together (a diffusion model
    fills the ``max_new_tokens`` positions after its prompt, an autoregressive one generates
    them left to right). A prompt whose tokens plus ``max_new_tokens`` exceed the network's
    ``max_seq_len`` needs ``plan.block_len`` (diffusion; refused for an autoregressive export).
    """
    _check_positive("max_new_tokens", max_new_tokens)
    _check_positive("--batch-size", batch_size)
    objective = check_plan(exported, plan)
    indices = list(range(len(prompts))) if indices is None else list(indices)
    shown = [None] * len(prompts) if shown is None else list(shown)
    by_length: dict[int, list[int]] = {}
    for position, tokens in enumerate(prompts):
        by_length.setdefault(len(tokens), []).append(position)
    max_seq_len = exported.network.config.max_seq_len
    batches = []
    for length, positions in sorted(by_length.items()):
        if length + max_new_tokens > max_seq_len and (objective == AUTOREGRESSIVE or plan.block_len is None) \
                and exported.spec.block_size is None:
            raise UserError(f"prompt {positions[0]} is {length} tokens: with max_new_tokens {max_new_tokens} it "
                            f"exceeds the network's max_seq_len {max_seq_len}"
                            + ("" if objective == AUTOREGRESSIVE else " (generate it in blocks: plan.block_len)"))
        for start in range(0, len(positions), batch_size):
            chosen = positions[start:start + batch_size]
            prefix = torch.tensor([list(prompts[i]) for i in chosen], dtype=torch.long).view(len(chosen), length)
            if objective == DIFFUSION:
                generate_id = exported.process(validate=False).generate_id
                prefix = torch.cat([prefix, torch.full((len(chosen), max_new_tokens), generate_id)], dim=1)
            batches.append(_Batch([indices[i] for i in chosen], prefix, [shown[i] for i in chosen],
                                  length + max_new_tokens))
    drawn = {sample.index: sample for sample in _draw(exported, plan, batches, objective, device)}
    return [drawn[index] for index in indices]


def _draw(exported: Exported, plan: SamplingPlan, batches: list[_Batch], objective: str,
          device: str | None) -> list[Sample]:
    """Every batch, in order, on ``device`` (None: the GPU when there is one), with a progress
    bar (of batches; of blocks for a block diffusion, whose one sample may run for minutes):
    under inference mode, and on a GPU as evaluation runs the network (``evaluation.inference``:
    bf16 autocast, the fastest attention kernel), its blocks compiled as the plan's ``compile`` says."""
    target = resolve_device(device)
    network = exported.network.to(target).eval()
    block_size = exported.spec.block_size
    # A block diffusion's sampler runs its cache between the blocks' calls: not compiled.
    # Neither do the prefix and dual caches (model.sampling.window), whose forwards carry them, nor
    # an autoregressive model's KV cache (one new row per call: little for a compile to gain).
    cached = (block_size is not None or plan.prefix_cache is not None or plan.dual_cache is not None
              or objective == AUTOREGRESSIVE)
    if not cached and should_compile(plan.compile, target, _network_tokens(plan, batches)):
        network.compile_parts()
    draw = _autoregressive_batch if objective == AUTOREGRESSIVE else _diffusion_batch
    steps = [1 if block_size is None else -(-batch.seq_len // block_size) for batch in batches]
    samples = []
    with (torch.inference_mode(), inference_mode(network, target),
          progress_bar(total=sum(steps), desc="sample", unit="batch" if block_size is None else "block") as bar):
        for batch, step in zip(batches, steps):
            done = bar.n
            if block_size is None:
                samples += draw(exported, network, plan, batch, target)
            else:
                samples += _diffusion_batch(exported, network, plan, batch, target, on_block=bar.update)
            bar.update(done + step - bar.n)  # the batch, or the blocks an early EOS left undrawn
    return samples


def _network_tokens(plan: SamplingPlan, batches: list[_Batch]) -> int:
    """An upper bound on the tokens the batches pass through a diffusion model's network: rows x
    length x calls per row (the tokens to generate for first-hitting, else the budget per block)."""
    total = 0
    for batch in batches:
        rows, length = batch.conditioning.shape[0], batch.seq_len
        if plan.steps is None:
            calls = length
        else:
            calls = plan.steps * (1 if plan.block_len is None else -(-length // plan.block_len))
        total += rows * length * calls
    return total


def until_eos_plan(exported: Exported, plan: SamplingPlan) -> SamplingPlan:
    """``plan`` stopping each sample at the tokenizer's EOS (``--until-eos``): block diffusion
    exports only (a UserError naming the flag otherwise)."""
    if exported.spec.block_size is None:
        why = ("an autoregressive model samples at most its max_seq_len tokens, and its text already ends at the "
               "first EOS" if exported.spec.objective == AUTOREGRESSIVE else
               "this model samples the whole sequence at once")
        raise UserError(f"--until-eos needs a block diffusion export (model.block_size), which samples block by "
                        f"block until the EOS, any length: {why}; leave --until-eos out")
    return replace(plan, until_eos=exported.tokenizer.eos_id)


def check_plan(exported: Exported, plan: SamplingPlan, *, seq_len: int | None = None,
               infill: str | None = None, steps_flag: str = "--steps") -> str:
    """The export's objective, once ``plan`` (and ``seq_len``, ``infill``) fit it; else a UserError
    naming the flag (``steps_flag``: the command's budget flag): ``check_sampling`` for this export."""
    return check_sampling(plan, objective=exported.config.get("objective"), process=exported.spec.process,
                          max_seq_len=exported.network.config.max_seq_len, seq_len=seq_len, infill=infill,
                          steps_flag=steps_flag, block_size=exported.spec.block_size)


def check_sampling(plan: SamplingPlan, *, objective: str | None, process: str, max_seq_len: int,
                   seq_len: int | None = None, infill: str | None = None, steps_flag: str = "--steps",
                   block_size: int | None = None) -> str:
    """``objective``, once ``plan`` fits a model of that objective, diffusion ``process`` kind and
    context ``max_seq_len`` (an export's, or a config's before its training); else a UserError
    naming the flag: a sampler the process does not take, a sequence or block longer than the
    network's context, a budget past its limits (``model.sampling.check_budget``), an
    autoregressive model asked to infill or to use blocks. ``seq_len`` None: ``max_seq_len``.
    ``block_size``: a block diffusion model's (``model.block_size``), which samples any length in
    its own blocks."""
    if objective not in (DIFFUSION, AUTOREGRESSIVE):
        raise UserError(f"export objective {objective!r} is not one of {DIFFUSION}, {AUTOREGRESSIVE}")
    if seq_len is not None:
        _check_positive("--seq-len", seq_len)
    if objective == AUTOREGRESSIVE:
        _check_autoregressive(plan, seq_len, max_seq_len, infill)
        return objective
    try:
        sampler = PROCESS_TYPES[process].sampler(plan.sampler)
    except ValueError as err:
        raise UserError(f"--sampler {plan.sampler}: {err}") from None
    _check_fast_generation(plan, sampler, block_size)
    _check_whole_sequence(plan, process, block_size, max_seq_len if seq_len is None else seq_len, max_seq_len)
    if block_size is not None:  # block diffusion: its own blocks, any length (model.sampling.blocks)
        if plan.compile == "on":
            raise UserError(f"--compile on: {BLOCKS_UNCOMPILED}; leave --compile auto or off")
        if plan.block_len is not None and plan.block_len != block_size:
            raise UserError(f"--block-len {plan.block_len}: this block diffusion export samples in its own blocks "
                            f"of {block_size} tokens; leave --block-len out")
        plan = replace(plan, block_len=block_size)   # the budget is per block
    elif plan.block_len is not None and plan.block_len > max_seq_len:
        raise UserError(f"--block-len {plan.block_len} exceeds the network's max_seq_len {max_seq_len}")
    if seq_len is not None and seq_len > max_seq_len and plan.block_len is None:
        raise UserError(f"--seq-len {seq_len} exceeds the network's max_seq_len {max_seq_len}: add --block-len "
                        f"(at most {max_seq_len}) to generate it in semi-autoregressive blocks")
    try:
        check_budget(plan, max_seq_len if seq_len is None else seq_len)
    except PlanError as err:
        raise UserError(f"{'--seq-len' if err.field == 'seq_len' else steps_flag}: {err}") from None
    return objective


def _check_fast_generation(plan: SamplingPlan, sampler, block_size: int | None) -> None:
    """--prefix-cache, --dual-cache and --guidance where they apply (docs/fast-generation.md)."""
    if block_size is not None and plan.prefix_cache is not None:
        raise UserError("--prefix-cache: a block diffusion export caches its finished blocks exactly already; leave "
                        "--prefix-cache out")
    if block_size is not None and plan.guidance is not None:
        raise UserError("--guidance: a block diffusion export holds the prompt in its blocks' KV cache, which an "
                        "unprompted second pass cannot share; leave --guidance out")
    cache = "prefix" if plan.prefix_cache is not None else "dual" if plan.dual_cache is not None else None
    if cache is not None and plan.compile == "on":
        raise UserError(f"--compile on: the {cache} cache runs between the network's calls, uncompiled; leave "
                        f"--compile auto or off")
    if cache is not None and sampler is reverse_sample:
        raise UserError(f"--{cache}-cache: the {plan.sampler} sampler of this process asks the network for every "
                        f"position at every step, the cached ones too; use it with an absorbing export (or the "
                        f"confidence sampler), or leave --{cache}-cache out")


def _check_whole_sequence(plan: SamplingPlan, process: str, block_size: int | None, seq_len: int,
                          max_seq_len: int) -> None:
    """--whole-sequence and --dual-cache where they apply (docs/fast-generation.md)."""
    if not plan.whole_sequence:
        return
    if block_size is not None:
        raise UserError("--whole-sequence: a block diffusion export attends to its finished blocks only, as it was "
                        "trained; leave --whole-sequence out")
    if not hasattr(PROCESS_TYPES[process], "mask_id"):
        raise UserError(f"--whole-sequence shows the network the suffix masked, which only an absorbing export has "
                        f"(this one is {process}); leave --whole-sequence out")
    if seq_len > max_seq_len:
        raise UserError(f"--whole-sequence shows the network all {seq_len} positions, more than its max_seq_len "
                        f"{max_seq_len}: shorten --seq-len or leave --whole-sequence out")


def _check_autoregressive(plan: SamplingPlan, seq_len: int | None, max_seq_len: int, infill: str | None) -> None:
    if infill is not None:
        raise UserError("--infill needs a diffusion export: an autoregressive model only "
                        "continues a --prompt left to right")
    if plan.sampler != "ancestral":
        raise UserError(f"--sampler {plan.sampler} needs a diffusion export: an autoregressive model samples "
                        f"left to right (the default, ancestral)")
    if plan.block_len is not None:
        raise UserError("--block-len needs a diffusion export: an autoregressive model already generates "
                        "left to right")
    if plan.guidance is not None:
        raise UserError("--guidance needs a diffusion export: its unconditional pass masks the prompt, which an "
                        "autoregressive model cannot read; leave --guidance out")
    if plan.compile == "on":
        raise UserError("--compile on: an autoregressive model samples one new token per call against its KV "
                        "cache, uncompiled; leave --compile auto or off")
    if seq_len is not None and seq_len > max_seq_len:
        raise UserError(f"--seq-len {seq_len} exceeds the network's max_seq_len {max_seq_len}")


def _check_positive(flag: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{flag} must be an integer >= 1, got {value!r}")


def _diffusion_batch(exported: Exported, network: torch.nn.Module, plan: SamplingPlan, batch: _Batch,
                     device: torch.device, on_block: Callable[[], object] | None = None) -> list[Sample]:
    """The batch's samples; ``on_block``: called after each block of a block diffusion."""
    diffusion = exported.process(validate=True)  # checks the prompt's token ids
    blocks = {} if on_block is None else {"on_block": on_block}
    tokens, stats = diffusion.sample(network, plan, num_samples=len(batch.indices), seq_len=batch.seq_len,
                                     prompt=batch.conditioning.to(device), generator=sample_generators(
                                         plan.seed, batch.indices), window=exported.network.config.max_seq_len,
                                     device=device, **blocks)
    return [_sample(exported.tokenizer, row, _conditioning_end(kept, diffusion.generate_id), calls, shown, plan, index)
            for row, kept, calls, shown, index in zip(tokens.tolist(), batch.conditioning, stats.row_calls,
                                                      batch.shown, batch.indices)]


def _conditioning_end(conditioning: Tensor, generate_id: int) -> int:
    """One past the last kept position: where a document end (EOS) may first cut the text."""
    kept = (conditioning != generate_id).nonzero()
    return int(kept.max()) + 1 if kept.numel() else 0


def _autoregressive_prefix(tokenizer: Tokenizer, prompt: str | None, seq_len: int) -> list[int]:
    prefix = tokenizer.encode(prompt) if prompt is not None else []
    if len(prefix) >= seq_len:
        raise UserError(f"--prompt is {len(prefix)} tokens, which leaves nothing to generate in "
                        f"--seq-len {seq_len}")
    return prefix


def _autoregressive_batch(exported: Exported, network: torch.nn.Module, plan: SamplingPlan, batch: _Batch,
                          device: torch.device) -> list[Sample]:
    prefix = batch.conditioning.shape[1]
    tokens = autoregressive_sample(network, exported.network.config.vocab_size, batch.conditioning.to(device),
                            batch.seq_len, plan, sample_generators(plan.seed, batch.indices))
    return [_sample(exported.tokenizer, row, prefix, batch.seq_len - prefix, shown, plan, index)
            for row, shown, index in zip(tokens.tolist(), batch.shown, batch.indices)]


def autoregressive_sample(network: torch.nn.Module, vocab_size: int, prefix: Tensor, seq_len: int,
                          plan: SamplingPlan, generators: list[torch.Generator]) -> Tensor:
    """Ancestral sampling from a causal network that reads ``[start, x_0, ...]`` (start id V),
    after ``prefix`` [B, P].

    Tokens are drawn by inverse CDF from the plan's float64 distribution, one uniform per row
    per token from the row's own generator, as in the diffusion samplers. After the first call
    (the start token and the prefix) each call reads only the newest token against the keys and
    values of those before it (``KVCache``): one row per call, not the whole context. A network
    that masks attention at document boundaries (``model.documents``) reads the whole context
    at every call, its mask built from the tokens.
    """
    rows, device = prefix.shape[0], prefix.device
    tokens = torch.empty((rows, seq_len), dtype=torch.long, device=device)
    tokens[:, :prefix.shape[1]] = prefix
    start = torch.full((rows, 1), vocab_size, dtype=torch.long, device=device)
    every_row = torch.ones(rows, dtype=torch.bool)
    cached = not masks_documents(network)
    layout = AttentionLayout(positions=None, mask=None, cache=KVCache(append=True)) if cached else None
    new = torch.cat([start, prefix], dim=1)   # [B, 1 + P]: the first call's rows
    for position in range(prefix.shape[1], seq_len):
        context = new if cached else torch.cat([start, tokens[:, :position]], dim=1)
        logits = _next_token_logits(network, context, layout)
        u = row_uniforms((), generators, every_row, device)
        tokens[:, position] = inverse_cdf(token_probs(logits, plan), u)
        new = tokens[:, position:position + 1]   # [B, 1]
    return tokens


def _next_token_logits(network: torch.nn.Module, rows: Tensor, layout: AttentionLayout | None) -> Tensor:
    """Logits [B, V] at the last of ``rows`` [B, R] (a ``Transformer`` skips the output
    projection elsewhere), after ``layout``'s cache when there is one."""
    last = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
    last[:, -1] = True
    return network(rows, None, output_mask=last, layout=layout)


def _sample(tokenizer: Tokenizer, tokens: list[int], kept_end: int, calls: int, prompt: str | None,
            plan: SamplingPlan, index: int) -> Sample:
    cut = next((i for i in range(kept_end, len(tokens)) if tokens[i] == tokenizer.eos_id), len(tokens))
    return Sample(text=tokenizer.decode(tokens[:cut]), tokens=tokens, text_tokens=cut, network_calls=calls,
                  prompt=prompt, plan=plan, index=index)
