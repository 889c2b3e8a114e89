"""The ``unmask lm-eval`` command: its flags, and the summary it prints (``evaluation.downstream.run``
does the work)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from common.logs import configure_logging
from evaluation.inference import DEVICE_HELP
from evaluation.results import DownstreamResults
from model.sampling import SAMPLERS

RAW = argparse.RawDescriptionHelpFormatter

DESCRIPTION = """\
Score an export on lm-evaluation-harness tasks (LAMBADA, HellaSwag, PIQA, ARC, WinoGrande, ...
or your own YAMLs) as lm-eval scores every language model. A diffusion model's log-likelihoods
are Monte Carlo lower bounds (the conditional ELBO, K time samples per request, standard error
kept); an autoregressive model's are exact. Writes lm-eval's own results (lm_eval_results.json)
and downstream.json into the report directory, adds a "Downstream tasks" table to report.md and
report.html, and logs the metrics to the MLflow run of the perplexity bounds.

Runs offline unless --download: datasets must be local (the tasks shipped in
evaluation/downstream/tasks read --data-dir) or in the Hugging Face cache.
"""

EPILOG = """\
local tasks (read --data-dir, laid out as ../shared/data):
  lambada_openai_local   lm-eval's lambada_openai on OpenAI's test file (acc, perplexity)
  wikitext2_local        WikiText-2 raw test articles as unmask eval reads them (bits per byte)
  ptb_word_order         two-way choice: a PTB sentence's true second half or its words shuffled

examples:
  unmask lm-eval runs/tiny --tasks lambada_openai_local,ptb_word_order --data-dir ../shared/data
  unmask lm-eval runs/tiny --tasks lambada_openai_local --data-dir ../shared/data --limit 500 --samples 64
  unmask lm-eval runs/m --tasks lambada_openai,hellaswag,piqa,arc_easy,winogrande --download
  unmask lm-eval runs/m/export --tasks my_task --include-path my_tasks/ --out reports/m
  unmask lm-eval runs/m --tasks my_task --include-path my_tasks/ --allow-code   # its YAML has !function
"""


def _limit(text: str) -> float | int:
    """``--limit``: a whole number of documents N >= 1, or a fraction in (0, 1) of each task's.
    lm-eval would cut 1.5 to 1 without a word: a number >= 1 must be whole."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0 or (value >= 1 and not value.is_integer()):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a whole number of documents (>= 1) nor a fraction "
                                         f"of them in (0, 1)")
    return int(value) if value >= 1 else value


def _cmd_lm_eval(args: argparse.Namespace) -> int:
    # Imported when the command runs: lm-eval, datasets and MLflow would slow every other command.
    from evaluation.downstream.run import DownstreamConfig, DownstreamOptions, run_downstream

    configure_logging()
    config = DownstreamConfig(
        tasks=tuple(name.strip() for name in args.tasks.split(",") if name.strip()),
        include_path=tuple(args.include_path or ()), data_dir=args.data_dir, limit=args.limit,
        num_fewshot=args.num_fewshot, samples=args.samples, seed=args.seed, batch_size=args.batch_size,
        gen_sampler=args.gen_sampler, gen_steps=args.gen_steps, gen_guidance=args.gen_guidance, download=args.download,
        allow_code=args.allow_code, guidance=args.guidance, gen_block_len=args.gen_block_len,
        gen_whole_sequence=args.gen_whole_sequence, gen_dual_cache=args.gen_dual_cache)
    options = DownstreamOptions(out=Path(args.out) if args.out else None, mlflow_uri=args.mlflow_uri,
                                device=args.device)
    report = run_downstream(Path(args.path), config, options)
    _print_summary(report.results, report.files.markdown, report.lm_eval_results)
    return 0


def _print_summary(results: DownstreamResults, report: Path, lm_eval_results: Path) -> None:
    for task, record in results.tasks.items():
        values = ", ".join(f"{key} {value:.4f}" + (f" ± {error:.4f}" if error is not None else "")
                           for key, (value, error) in record.values().items())
        print(f"{task:>24}: {values} ({record.documents:,} documents)")
    print(f"report: {report}")
    print(json.dumps({"mlflow_run_id": results.mlflow.run_id if results.mlflow else None, "report": str(report),
                      "lm_eval_results": str(lm_eval_results)}))


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``lm-eval`` to the ``unmask`` command."""
    parser = commands.add_parser(
        "lm-eval", help="downstream tasks through lm-evaluation-harness -> MLflow and RUN/report/",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=RAW)
    parser.add_argument("path", metavar="RUN_OR_EXPORT", help="a training run (exported first if needed) "
                                                              "or an export directory")
    parser.add_argument("--tasks", required=True,
                        help="comma-separated lm-eval task, group or tag names (glob patterns too), or YAML paths")
    parser.add_argument("--include-path", action="append", metavar="DIR",
                        help="a directory of your own lm-eval task YAMLs (repeatable)")
    parser.add_argument("--allow-code", action="store_true",
                        help="let your task YAMLs (--include-path, --tasks paths) name Python with '!function "
                             "module.fn', which lm-eval imports and runs from their directory (default: refused)")
    parser.add_argument("--data-dir", help="root of the local tasks' files (layout of ../shared/data)")
    parser.add_argument("--limit", type=_limit, metavar="N",
                        help="only the first N documents of each task (a fraction when < 1), as lm-eval's --limit")
    parser.add_argument("--num-fewshot", type=int, metavar="N", help="few-shot examples per prompt "
                                                                    "(default: each task's own)")
    parser.add_argument("--samples", type=int, default=16, help="time samples per loglikelihood request K "
                                                                "(diffusion; default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, metavar="ROWS",
                        help="rows per forward pass (default: by the device's capacity)")
    parser.add_argument("--gen-sampler", choices=SAMPLERS, default="ancestral",
                        help="how a diffusion model samples for generation tasks (default: %(default)s; "
                             "unmask sample --help lists them)")
    parser.add_argument("--gen-steps", type=int, metavar="T",
                        help="its budget of network calls for generation tasks (default: one per generated token)")
    parser.add_argument("--gen-guidance", type=float, metavar="W",
                        help="unsupervised classifier-free guidance of weight W >= 0 towards the context in "
                             "generation tasks (diffusion; two network calls a step; docs/fast-generation.md)")
    parser.add_argument("--gen-block-len", type=int, metavar="N",
                        help="generate in semi-autoregressive blocks of N tokens (diffusion; docs/fast-generation.md)")
    parser.add_argument("--gen-whole-sequence", action="store_true",
                        help="with --gen-block-len: every call sees the whole sequence, the masked rest too")
    parser.add_argument("--gen-dual-cache", type=int, metavar="N",
                        help="with --gen-whole-sequence: the dual cache, refreshed every N calls (approximate)")
    parser.add_argument("--guidance", type=float, metavar="W",
                        help="score loglikelihood requests by guided logits of weight W >= 0 towards the context: "
                             "a ranking of the choices, not a likelihood bound (two forward passes; "
                             "docs/fast-generation.md)")
    parser.add_argument("--download", action="store_true",
                        help="let lm-eval download the tasks' datasets from the Hugging Face Hub (default: offline)")
    parser.add_argument("--out", help="report directory (default RUN/report)")
    parser.add_argument("--mlflow-uri", help="log to this server in a new run (default: the training's run)")
    parser.add_argument("--device", help=DEVICE_HELP)
    parser.set_defaults(handler=_cmd_lm_eval)
