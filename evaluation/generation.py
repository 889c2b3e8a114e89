"""``unmask sample``: generate text from an export, unconditionally, after a prompt, or by infilling.

    exported = load_export(resolve_export(Path("runs/tiny")))
    samples = generate(exported, num=4, steps=1000, prompt="Once upon a time")
    print(samples[0].text, samples[0].network_calls)

Diffusion exports sample with ``MaskedDiffusion.sample`` (ancestral, cached network calls)
under the schedule they were trained with. Conditioning is a tensor of kept tokens and mask
ids: ``--prompt`` keeps its tokens at the start of the sequence and generates the rest;
``--infill`` takes a template whose literal text is kept in place and whose placeholders
(``INFILL_SYNTAX``) are generated, as is everything after the template. Autoregressive
exports sample left to right (temperature 1, optional nucleus ``top_p``) and continue a
``--prompt``; they cannot infill.

Text. ``Sample.tokens`` is the whole sampled sequence (``seq_len`` ids). ``Sample.text``
decodes it up to, not including, the first EOS after the last kept token (the prompt's
last token, or the template's last literal token): the model marks a document's end with
EOS and what follows belongs to an unrelated document. An EOS generated between kept
tokens stays (a SentencePiece EOS decodes to nothing).

Cost. ``Sample.network_calls`` counts the network evaluations of that sample's sequence.
A diffusion batch reports only its total (``SamplingStats.rows_evaluated``: rows passed
through the denoiser, summed over calls); each sample gets that total divided by the
batch's rows, rounded up, which is exact for ``batch_size=1``. With caching it is at most
the number of generated positions, however many steps. An autoregressive sample costs
one evaluation per generated token (no KV cache: each one re-reads the whole prefix).

Determinism. One ``torch.Generator`` seeded with ``seed`` on the sampling device draws
every batch in turn, so the same export, arguments, batch size and device give the same
samples; a different batch size or device gives different (equally valid) samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from data_prep.atomic_files import atomic_write_bytes
from data_prep.tokenizer import Tokenizer
from model.diffusion import MaskedDiffusion
# The diffusion sampler's float64 inverse-CDF draw: the AR sampler draws its tokens the same way.
from model.sampling import GRIDS, inverse_cdf, top_p_filter
from model.schedules import make_schedule
from pipeline.errors import UserError, output_file
from pipeline.export import Exported, resolve_export

__all__ = ["INFILL_PLACEHOLDER", "INFILL_SYNTAX", "Sample", "build_prompt", "generate",
           "register", "resolve_export"]

# An infill placeholder: "[MASK]" is one generated token, "[MASK*n]" n of them (n >= 1).
INFILL_PLACEHOLDER = re.compile(r"\[MASK(?:\*(\d+))?\]")
INFILL_SYNTAX = "[MASK] for one generated token, [MASK*n] for n of them"
# Anything starting like a placeholder that the pattern above did not consume is a typo.
_PLACEHOLDER_START = "[MASK"

DIFFUSION, AUTOREGRESSIVE = "diffusion", "autoregressive"
DEFAULT_BATCH_SIZE = 8
DEFAULT_GRID = "uniform"
SAMPLE_SEPARATOR = "----- sample {index} (network calls: {calls}) -----"
RAW = argparse.RawDescriptionHelpFormatter

SAMPLE_DESCRIPTION = """\
Sample text from an export. Diffusion exports run the ancestral sampler with cached
network calls (steps >> seq-len costs at most seq-len evaluations per sample);
autoregressive exports sample left to right. Text goes to stdout, one block per sample,
or to --out as JSONL (text, tokens, network_calls, steps, prompt). The text stops at the
first EOS after the last kept token of the prompt or template.
"""

SAMPLE_EPILOG = f"""\
infill templates: literal text is kept in place; {INFILL_SYNTAX}.
The template must fit in --seq-len; the positions after it are generated too.

examples:
  unmask sample runs/tiny --num 4 --steps 1000
  unmask sample runs/tiny/export --num 2 --steps 256 --grid cosine --top-p 0.9 --prompt "Once upon a time"
  unmask sample runs/tiny --num 1 --steps 128 --infill "The [MASK*8] sat on the [MASK*3]." --seq-len 32
  unmask sample runs/tiny-ar --num 8 --prompt "The" --seq-len 128 --out samples.jsonl
"""


@dataclass(frozen=True)
class Sample:
    """One generated sequence; see the module docstring for ``text`` and ``network_calls``."""

    text: str                # decoded up to the first EOS after the last kept token
    tokens: list[int]        # the whole sequence, seq_len ids
    network_calls: int       # network evaluations of this sequence
    steps: int               # diffusion: reverse steps; autoregressive: tokens generated
    prompt: str | None       # the --prompt text or the --infill template


# ------------------------------------------------------------------ locating the export
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
    target = _device(device)
    network = exported.network.to(target).eval()
    generator = torch.Generator(device=target).manual_seed(seed)
    sizes = _batches(num, batch_size)
    with torch.inference_mode():
        if objective == AUTOREGRESSIVE:
            return _sample_autoregressive(exported, network, sizes, seq_len=seq_len, prompt=prompt,
                                          top_p=top_p, generator=generator, device=target)
        return _sample_diffusion(exported, network, sizes, steps=steps, seq_len=seq_len, grid=grid,
                                 prompt=prompt, infill=infill, top_p=top_p, generator=generator,
                                 device=target)


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


def _device(name: str) -> torch.device:
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
    config = exported.config
    vocab_size = exported.network.config.vocab_size
    schedule = make_schedule(config["schedule"], **config.get("schedule_args", {}))
    diffusion = MaskedDiffusion(schedule, vocab_size)
    conditioning = build_prompt(exported.tokenizer, seq_len, diffusion.mask_id, prompt=prompt, infill=infill)
    kept_end = _conditioning_end(conditioning, diffusion.mask_id)
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


def _next_token_logits(network: torch.nn.Module, context: Tensor) -> Tensor:
    """Logits [B, V] at the last position of ``context``."""
    if getattr(network, "accepts_output_mask", False):
        last = torch.zeros(context.shape, dtype=torch.bool, device=context.device)
        last[:, -1] = True
        return network(context, None, output_mask=last)  # skips the projection elsewhere
    return network(context, None)[:, -1]


def _sample(tokenizer: Tokenizer, tokens: list[int], kept_end: int, calls: int, steps: int,
            prompt: str | None) -> Sample:
    cut = next((i for i in range(kept_end, len(tokens)) if tokens[i] == tokenizer.eos_id), len(tokens))
    return Sample(text=tokenizer.decode(tokens[:cut]), tokens=tokens, network_calls=calls, steps=steps,
                  prompt=prompt)


# ------------------------------------------------------------------ command line
def _cmd_sample(args: argparse.Namespace) -> int:
    from pipeline.export import load_export

    if args.out is not None:
        output_file(args.out, "--out")  # before sampling, not after it
    exported = load_export(resolve_export(Path(args.run_or_export)))
    samples = generate(exported, num=args.num, steps=args.steps, seq_len=args.seq_len, grid=args.grid,
                       prompt=args.prompt, infill=args.infill, top_p=args.top_p, seed=args.seed,
                       batch_size=args.batch_size, device=args.device)
    if args.out is None:
        _print_samples(samples)
        return 0
    lines = "".join(json.dumps(dataclasses.asdict(sample), ensure_ascii=False) + "\n" for sample in samples)
    atomic_write_bytes(Path(args.out), lines.encode("utf-8"))
    print(f"wrote {len(samples)} samples to {args.out}")
    return 0


def _print_samples(samples: list[Sample]) -> None:
    for index, sample in enumerate(samples, start=1):
        print(SAMPLE_SEPARATOR.format(index=index, calls=sample.network_calls))
        print(sample.text)
    sys.stdout.flush()


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``sample`` to the ``unmask`` command."""
    parser = commands.add_parser(
        "sample", help="generate text from an export (unconditional, --prompt or --infill)",
        description=SAMPLE_DESCRIPTION,
        epilog=SAMPLE_EPILOG, formatter_class=RAW)
    parser.add_argument("run_or_export", metavar="RUN_OR_EXPORT", help="a training run (uses RUN/export) "
                        "or an export directory")
    parser.add_argument("--num", type=int, required=True, help="number of samples")
    parser.add_argument("--steps", type=int, help="reverse diffusion steps (required for diffusion "
                        "exports; autoregressive exports generate one token per step)")
    parser.add_argument("--grid", choices=GRIDS, default=DEFAULT_GRID,
                        help="time grid of the reverse steps (default: %(default)s)")
    conditioning = parser.add_mutually_exclusive_group()
    conditioning.add_argument("--prompt", metavar="TEXT", help="text to continue: kept at the start")
    conditioning.add_argument("--infill", metavar="TEMPLATE",
                              help=f"text with spans to fill: {INFILL_SYNTAX} (diffusion only)")
    parser.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling: keep the most likely "
                        "tokens holding mass P, in (0, 1] (default: the full distribution)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, metavar="L", help="sequence length in tokens (default: "
                        "the network's max_seq_len)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, metavar="B",
                        help="samples drawn together (default: %(default)s); samples depend on it")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: %(default)s)")
    parser.add_argument("--out", metavar="FILE.jsonl", help="write JSONL here instead of text to stdout")
    parser.set_defaults(handler=_cmd_sample)
