"""Text generation from an export, unconditionally, after a prompt, or by infilling (the
library behind ``unmask sample``, whose command line is ``orchestration.commands.sample``).

    exported = load_export(resolve_export(Path("runs/tiny")))
    samples = generate(exported, num=4, steps=1000, prompt="Once upon a time")
    print(samples[0].text, samples[0].network_calls)

Diffusion exports sample with their process's ``sample`` (ancestral, cached network calls)
under the process and schedule they were trained with (a learned schedule with its trained
theta). Conditioning is a tensor of kept tokens and mask ids: ``prompt`` keeps its tokens
at the start of the sequence and generates the rest; ``infill`` takes a template whose
literal text is kept in place and whose placeholders (``INFILL_SYNTAX``) are generated, as is
everything after the template. Autoregressive exports sample left to right (temperature 1,
optional nucleus ``top_p``) and continue a ``prompt``; they cannot infill. Bad arguments
raise ``UserError`` naming the flag of ``unmask sample`` that sets them.

Text. ``Sample.tokens`` is the whole sampled sequence (``seq_len`` ids). ``Sample.text``
decodes it up to, not including, the first EOS after the last kept token (the prompt's
last token, or the template's last literal token): the model marks a document's end with
EOS and what follows belongs to an unrelated document. An EOS generated between kept
tokens stays (a SentencePiece EOS decodes to nothing). ``Sample.text_tokens`` is how many
leading ids the text decodes: what sample quality (``evaluation.sample_quality``) scores.
Every sample also records how it was drawn: ``steps``, ``grid``, ``top_p`` and ``seed``.

Cost. ``Sample.network_calls`` counts the network evaluations of that sample's sequence.
A diffusion batch reports only its total (``SamplingStats.rows_evaluated``: rows passed
through the denoiser, summed over calls); each sample gets that total divided by the
batch's rows, rounded up, which is exact for ``batch_size=1``. With caching it is at most
the number of generated positions, however many steps, for the absorbing process; the
uniform and learned processes need the network at every step where a row changed (and at
every step for a time-conditioned network). An autoregressive sample costs
one evaluation per generated token (no KV cache: each one re-reads the whole prefix).

Determinism. One ``torch.Generator`` seeded with ``seed`` on the sampling device draws
every batch in turn, so the same export, arguments, batch size and device give the same
samples; a different batch size or device gives different (equally valid) samples.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from common.errors import UserError
from common.progress import bar as progress_bar
from data_prep.tokenizer import Tokenizer
from model.denoiser import Denoiser

# The diffusion sampler's float64 inverse-CDF draw: the AR sampler draws its tokens the same way.
from model.sampling import GRIDS, inverse_cdf, top_p_filter
from pipeline.export import Exported

__all__ = ["INFILL_PLACEHOLDER", "INFILL_SYNTAX", "Sample", "build_prompt", "generate", "resolve_device",
           "GRIDS", "DEFAULT_BATCH_SIZE", "DEFAULT_GRID"]

# An infill placeholder: "[MASK]" is one generated token, "[MASK*n]" n of them (n >= 1).
INFILL_PLACEHOLDER = re.compile(r"\[MASK(?:\*(\d+))?\]")
INFILL_SYNTAX = "[MASK] for one generated token, [MASK*n] for n of them"
# Anything starting like a placeholder that the pattern above did not consume is a typo.
_PLACEHOLDER_START = "[MASK"

DIFFUSION, AUTOREGRESSIVE = "diffusion", "autoregressive"
DEFAULT_BATCH_SIZE = 8
DEFAULT_GRID = "uniform"


@dataclass(frozen=True)
class Sample:
    """One generated sequence; see the module docstring for ``text`` and ``network_calls``."""

    text: str                # decoded up to the first EOS after the last kept token
    tokens: list[int]        # the whole sequence, seq_len ids
    network_calls: int       # network evaluations of this sequence
    steps: int               # diffusion: reverse steps; autoregressive: tokens generated
    prompt: str | None       # the prompt text or the infill template
    text_tokens: int         # how many leading ids of ``tokens`` ``text`` decodes
    # How it was drawn (set by ``generate``): the time grid (None for an autoregressive
    # export), the nucleus (None: the full distribution) and the seed of its generator.
    grid: str | None = None
    top_p: float | None = None
    seed: int | None = None


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
def generate(exported: Exported, *, num: int, steps: int | None, seq_len: int | None = None,
             grid: str = DEFAULT_GRID, prompt: str | None = None, infill: str | None = None,
             top_p: float | None = None, seed: int = 0, batch_size: int = DEFAULT_BATCH_SIZE,
             device: str = "cpu") -> list[Sample]:
    """Draw ``num`` samples from ``exported``; see the module docstring.

    ``steps`` (reverse steps) is required for diffusion exports and ignored by
    autoregressive ones. ``seq_len`` defaults to the network's ``max_seq_len``. Bad
    arguments raise ``UserError`` naming the CLI flag.
    """
    objective = exported.config.get("objective")
    if objective not in (DIFFUSION, AUTOREGRESSIVE):
        raise UserError(f"export objective {objective!r} is not one of {DIFFUSION}, {AUTOREGRESSIVE}")
    seq_len = exported.network.config.max_seq_len if seq_len is None else seq_len
    _check_arguments(exported, objective, num=num, steps=steps, seq_len=seq_len, grid=grid,
                     infill=infill, top_p=top_p, batch_size=batch_size)
    target = resolve_device(device)
    network = exported.network.to(target).eval()
    generator = torch.Generator(device=target).manual_seed(seed)
    sizes = progress_bar(_batches(num, batch_size), desc="sample", unit="batch")
    with torch.inference_mode():
        if objective == AUTOREGRESSIVE:
            samples = _sample_autoregressive(exported, network, sizes, seq_len=seq_len, prompt=prompt,
                                             top_p=top_p, generator=generator, device=target)
        else:
            samples = _sample_diffusion(exported, network, sizes, steps=steps, seq_len=seq_len, grid=grid,
                                        prompt=prompt, infill=infill, top_p=top_p, generator=generator,
                                        device=target)
    drawn_on = None if objective == AUTOREGRESSIVE else grid
    return [replace(sample, grid=drawn_on, top_p=top_p, seed=seed) for sample in samples]


def _check_arguments(exported: Exported, objective: str, *, num: int, steps: int | None, seq_len: int,
                     grid: str, infill: str | None, top_p: float | None, batch_size: int) -> None:
    max_seq_len = exported.network.config.max_seq_len
    _check_positive("--num", num)
    _check_positive("--batch-size", batch_size)
    _check_positive("--seq-len", seq_len)
    if seq_len > max_seq_len:
        raise UserError(f"--seq-len {seq_len} exceeds the network's max_seq_len {max_seq_len}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise UserError(f"--top-p must lie in (0, 1], got {top_p}")
    if objective == AUTOREGRESSIVE:
        if infill is not None:
            raise UserError("--infill needs a diffusion export: an autoregressive model only "
                            "continues a --prompt left to right")
        return
    if steps is None:
        raise UserError("--steps is required for a diffusion export (the number of reverse steps)")
    _check_positive("--steps", steps)
    if grid not in GRIDS:
        raise UserError(f"--grid must be one of {', '.join(GRIDS)}, got {grid!r}")


def _check_positive(flag: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{flag} must be an integer >= 1, got {value!r}")


def resolve_device(name: str) -> torch.device:
    """The torch device ``name`` (cpu, cuda, cuda:1); a UserError naming ``--device`` when it
    is not one or is not on this machine."""
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise UserError(f"--device {name!r} is not a torch device ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine")
    return device


def _batches(num: int, batch_size: int) -> list[int]:
    """Sizes of the batches that draw ``num`` samples."""
    return [min(batch_size, num - start) for start in range(0, num, batch_size)]


def _sample_diffusion(exported: Exported, network: torch.nn.Module, sizes: list[int], *, steps: int,
                      seq_len: int, grid: str, prompt: str | None, infill: str | None,
                      top_p: float | None, generator: torch.Generator, device: torch.device) -> list[Sample]:
    diffusion = exported.process(validate=True)  # checks the prompt's token ids
    conditioning = build_prompt(exported.tokenizer, seq_len, diffusion.generate_id, prompt=prompt, infill=infill)
    kept_end = _conditioning_end(conditioning, diffusion.generate_id)
    shown = prompt if infill is None else infill
    samples = []
    for rows in sizes:
        tokens, stats = diffusion.sample(
            network, rows, seq_len, steps, generator=generator, grid=grid,
            prompt=None if conditioning is None else conditioning.to(device),
            top_p=top_p, device=device, return_stats=True)
        # Only the batch total is known; each row gets its share, rounded up (see the docstring).
        calls = math.ceil(stats.rows_evaluated / rows)
        samples += [_sample(exported.tokenizer, row, kept_end, calls, steps, shown)
                    for row in tokens.tolist()]
    return samples


def _conditioning_end(conditioning: Tensor | None, mask_id: int) -> int:
    """One past the last kept position: where a document end (EOS) may first cut the text."""
    if conditioning is None:
        return 0
    kept = (conditioning != mask_id).nonzero()
    return int(kept.max()) + 1 if kept.numel() else 0


def _sample_autoregressive(exported: Exported, network: torch.nn.Module, sizes: list[int], *,
                           seq_len: int, prompt: str | None, top_p: float | None,
                           generator: torch.Generator, device: torch.device) -> list[Sample]:
    prefix = exported.tokenizer.encode(prompt) if prompt is not None else []
    if len(prefix) >= seq_len:
        raise UserError(f"--prompt is {len(prefix)} tokens, which leaves nothing to generate in "
                        f"--seq-len {seq_len}")
    generated = seq_len - len(prefix)
    samples = []
    for rows in sizes:
        tokens = _left_to_right(network, exported.network.config.vocab_size, prefix, rows, seq_len,
                                top_p, generator, device)
        samples += [_sample(exported.tokenizer, row, len(prefix), generated, generated, prompt)
                    for row in tokens.tolist()]
    return samples


def _left_to_right(network: torch.nn.Module, vocab_size: int, prefix: list[int], rows: int, seq_len: int,
                   top_p: float | None, generator: torch.Generator, device: torch.device) -> Tensor:
    """Ancestral sampling from a causal network that reads ``[start, x_0, ...]`` (start id V).

    Tokens are drawn by inverse CDF from float64 probabilities, as in the diffusion sampler.
    """
    tokens = torch.empty((rows, seq_len), dtype=torch.long, device=device)
    tokens[:, :len(prefix)] = torch.tensor(prefix, dtype=torch.long, device=device)
    start = torch.full((rows, 1), vocab_size, dtype=torch.long, device=device)
    for position in range(len(prefix), seq_len):
        logits = _next_token_logits(network, torch.cat([start, tokens[:, :position]], dim=1))
        probs = torch.softmax(logits.to(torch.float64), dim=-1)
        if top_p is not None and top_p < 1.0:
            probs = top_p_filter(probs, top_p)
        u = torch.rand(rows, generator=generator, dtype=torch.float64, device=device)
        tokens[:, position] = inverse_cdf(probs, u)
    return tokens


def _next_token_logits(network: Denoiser, context: Tensor) -> Tensor:
    """Logits [B, V] at the last position of ``context`` (a ``Transformer`` skips the output
    projection elsewhere)."""
    last = torch.zeros(context.shape, dtype=torch.bool, device=context.device)
    last[:, -1] = True
    return network.logits_at(context, None, last)


def _sample(tokenizer: Tokenizer, tokens: list[int], kept_end: int, calls: int, steps: int,
            prompt: str | None) -> Sample:
    cut = next((i for i in range(kept_end, len(tokens)) if tokens[i] == tokenizer.eos_id), len(tokens))
    return Sample(text=tokenizer.decode(tokens[:cut]), tokens=tokens, network_calls=calls, steps=steps,
                  prompt=prompt, text_tokens=cut)
