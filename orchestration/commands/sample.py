"""``unmask sample``: generate text from an export (``evaluation.generation.generate``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from common.errors import UserError
from common.outputs import InputPath, check_output_file, write_output_file
from evaluation.generation.generate import DEFAULT_BATCH_SIZE, INFILL_SYNTAX, Sample, generate, until_eos_plan
from evaluation.generation.sample_quality import SampleQuality, check_reference, load_reference, score_samples
from evaluation.inference import DEVICE_HELP, resolve_device
from orchestration.commands.sampling_flags import (
    SAMPLE_FLAGS,
    SAMPLER_HELP,
    add_sampling_arguments,
    check_flags_apply,
    objective_of,
    plan_from_args,
)
from pipeline.interchange.export import export_directory, load_export
from pipeline.interchange.run_export import choose_export

RAW = argparse.RawDescriptionHelpFormatter
SAMPLE_SEPARATOR = "----- sample {index} (network calls: {calls}) -----"

SAMPLE_DESCRIPTION = """\
Sample text from an export. Diffusion exports run --sampler (ancestral by default, with
cached network calls: steps >> seq-len costs at most seq-len evaluations per sample;
first-hitting is exact at one call per token); autoregressive exports sample left to right.
Text goes to stdout, one block per sample, or to --out as JSONL (text, tokens, text_tokens,
network_calls, prompt, index, the sampling plan, and each sample's quality). The text stops
at the first EOS after the last kept token of the prompt or template. A sample depends on
--seed and its index, not on --batch-size.

Quality, after the samples: their mean unigram entropy (nats, of each sample's own tokens:
low values expose repetitive samples), and with --reference the generative perplexity of
their text under that autoregressive model. A reference with another tokenizer scores the
decoded text re-encoded with its own tokenizer, and says so.
"""

SAMPLE_EPILOG = f"""\
{SAMPLER_HELP}
infill templates: literal text is kept in place; {INFILL_SYNTAX}.
The template must fit in --seq-len; the positions after it are generated too.

examples:
  unmask sample runs/tiny --num 4 --steps 1000
  unmask sample runs/tiny --num 4 --sampler first-hitting --top-p 0.9
  unmask sample runs/tiny --num 4 --sampler remdm --steps 1024 --sampler-option schedule=loop
  unmask sample runs/tiny --num 2 --sampler confidence --steps 32 --temperature 0.8
  unmask sample runs/tiny --num 1 --sampler first-hitting --seq-len 1024 --block-len 128 --prompt "ROMEO:"
  unmask sample runs/tiny/export --num 2 --steps 256 --grid cosine --top-p 0.9 --prompt "Once upon a time"
  unmask sample runs/tiny --num 1 --steps 128 --infill "The [MASK*8] sat on the [MASK*3]." --seq-len 32
  unmask sample runs/tiny-ar --num 8 --prompt "The" --seq-len 128 --out samples.jsonl
  unmask sample runs/tiny --num 16 --steps 1000 --reference runs/tiny-ar --out samples.jsonl
  unmask sample runs/small --num 16 --steps 1000 --reference ~/models/gpt2-large   # a HF model dir
  unmask sample runs/bd3 --num 4 --steps 16 --seq-len 4096 --until-eos   # block diffusion: any length
"""


def _is_samples_file(path: Path) -> bool:
    """Whether ``path`` holds samples of this command (its first line is one): what --out may replace."""
    with open(path, "rb") as handle:
        first = handle.readline()
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and {"text", "tokens"} <= record.keys()


def _check_text(text: str | None, flag: str) -> None:
    """A text flag must be Unicode: bytes of the command line that are not UTF-8 reach Python
    as lone surrogates (U+DC80 + the byte), which no tokenizer encodes."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"the lone surrogate U+{code:04X}"
        raise UserError(f"{flag}: {what} at character {err.start} is not UTF-8 text; pass the text in UTF-8 "
                        f"(e.g. convert it with iconv -t UTF-8)") from None


def _cmd_sample(args: argparse.Namespace) -> int:
    _check_text(args.prompt, "--prompt")
    _check_text(args.infill, "--infill")
    if args.out is not None:  # before sampling, not after it; never into the export (it appears whole)
        check_output_file(args.out, "--out", inputs=[InputPath(export_directory(args.run_or_export),
                                                               "the export it samples")],
                          ours=_is_samples_file, noun="a samples file of `unmask sample`")
    if args.reference is not None:
        check_reference(Path(args.reference))
    plan = plan_from_args(args, SAMPLE_FLAGS, args.seed)
    check_flags_apply(args, SAMPLE_FLAGS, objective_of(Path(args.run_or_export)), args.run_or_export)
    device = resolve_device(args.device)
    exported = load_export(choose_export(args.run_or_export))  # RUN: its latest checkpoint's export, or refused
    if args.until_eos:
        plan = until_eos_plan(exported, plan)
    samples = generate(exported, plan, num=args.num, seq_len=args.seq_len, prompt=args.prompt, infill=args.infill,
                       batch_size=args.batch_size, device=str(device))
    reference = load_reference(Path(args.reference), device=device) if args.reference else None
    quality = score_samples(samples, exported.tokenizer, reference)
    if args.out is None:
        _print_samples(samples)
    else:
        lines = "".join(json.dumps({**sample.to_dict(), **dataclasses.asdict(score)}, ensure_ascii=False)
                        + "\n" for sample, score in zip(samples, quality.scores))
        write_output_file(args.out, lines.encode("utf-8"))
        print(f"wrote {len(samples)} samples to {args.out}")
    _print_quality(quality)
    return 0


def _print_samples(samples: list[Sample]) -> None:
    for index, sample in enumerate(samples, start=1):
        print(SAMPLE_SEPARATOR.format(index=index, calls=sample.network_calls))
        print(sample.text)
    sys.stdout.flush()


def _print_quality(quality: SampleQuality) -> None:
    print(f"mean unigram entropy: {quality.mean_unigram_entropy:.3f} nats")
    perplexity = quality.generative_perplexity
    if perplexity is not None:
        how = ("the decoded text re-encoded with the reference's tokenizer" if perplexity.retokenized
               else "the sampled tokens: the reference shares the tokenizer")
        print(f"generative perplexity: {perplexity.perplexity:.3f} under {perplexity.reference} "
              f"({perplexity.tokens:,} tokens; {how})")


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``sample`` to the ``unmask`` command."""
    parser = commands.add_parser(
        "sample", help="generate text from an export (unconditional, --prompt or --infill)",
        description=SAMPLE_DESCRIPTION,
        epilog=SAMPLE_EPILOG, formatter_class=RAW)
    parser.add_argument("run_or_export", metavar="RUN_OR_EXPORT", help="a training run (uses RUN/export) "
                        "or an export directory")
    parser.add_argument("--num", type=int, required=True, help="number of samples")
    add_sampling_arguments(parser, SAMPLE_FLAGS)
    conditioning = parser.add_mutually_exclusive_group()
    conditioning.add_argument("--prompt", metavar="TEXT", help="text to continue: kept at the start")
    conditioning.add_argument("--infill", metavar="TEMPLATE",
                              help=f"text with spans to fill: {INFILL_SYNTAX} (diffusion only)")
    parser.add_argument("--until-eos", action="store_true",
                        help="block diffusion exports: stop each sample after the block in which it generates "
                             "the tokenizer's EOS (--seq-len is then the most tokens)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, metavar="L", help="sequence length in tokens (default: "
                        "the network's max_seq_len; longer needs --block-len)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, metavar="B",
                        help="samples drawn together (default: %(default)s); the samples do not depend on it")
    parser.add_argument("--device", help=DEVICE_HELP)
    parser.add_argument("--out", metavar="FILE.jsonl", help="write JSONL here instead of text to stdout")
    parser.add_argument("--reference", metavar="PATH",
                        help="an autoregressive model that scores the samples (generative perplexity): an unmask "
                             "AR export or run, or a Hugging Face causal LM directory (needs transformers)")
    parser.set_defaults(handler=_cmd_sample)
