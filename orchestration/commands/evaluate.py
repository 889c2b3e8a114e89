"""The ``unmask eval`` command: its flags, and the summary it prints (``evaluation.zero_shot``
does the work)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.errors import UserError
from common.logs import configure_logging
from evaluation.bounds.detokenizers import DETOKENIZERS
from evaluation.bounds.protocols import DEFAULT_PROTOCOL, PROTOCOLS
from evaluation.bounds.scoring import ScoringConfig
from evaluation.bounds.suites import SUITES, ZERO_SHOT
from evaluation.inference import COMPILE_SETTINGS, DEVICE_HELP
from evaluation.results import EvalResults
from orchestration.commands.sampling_flags import (
    REPORT_FLAGS,
    REPORT_SAMPLER_HELP,
    add_sampling_arguments,
    check_flags_apply,
    check_samples_drawn,
    objective_of,
    plan_from_args,
)

RAW = argparse.RawDescriptionHelpFormatter

EVAL_EPILOG = f"""\
{REPORT_SAMPLER_HELP}
examples:
  unmask eval runs/tiny --datasets ptb,wikitext2,lambada,lm1b --data-dir ../shared/data
  unmask eval runs/tiny --datasets val --shards shards/ --samples 32
  unmask eval runs/m/export --datasets wikitext103 --data-dir data/ --target-rel-error 0.002
  unmask eval runs/m --datasets ptb,wikitext2,lambada,lm1b --data-dir data/ --protocol mdlm
  unmask eval runs/m --suite zero-shot --data-dir data/ --protocol duo --quick
  unmask eval runs/m --datasets lambada --data-dir data/ --detokenizer lambada_gpt2
  unmask eval runs/m --datasets ptb --data-dir data/ --num-samples 16 --reference runs/m-ar --sample-top-p 0.9
  unmask eval runs/m --datasets val --num-samples 8 --sampler first-hitting --reference runs/m-ar --sample-sweep
  torchrun --nproc-per-node 8 -m orchestration.cli eval runs/m --datasets lambada,ptb --data-dir data/
"""


# --quick: 16 time samples x 64 random blocks per dataset, whatever its size (docs/evaluation.md).
QUICK_BLOCKS_PER_REPLICATE = 64


def _eval_config(args: argparse.Namespace) -> ScoringConfig:
    if args.datasets is not None and args.suite is not None:
        raise UserError(f"--suite {args.suite} chooses its own datasets: give --datasets or --suite, not both")
    if args.datasets is None and args.suite is None:
        raise UserError(f"give --datasets NAMES, or --suite {ZERO_SHOT} for the seven sets of the papers' zero-shot "
                        f"table")
    return ScoringConfig(
        datasets=tuple(name.strip() for name in (args.datasets or "").split(",") if name.strip()),
        suite=args.suite, data_dir=args.data_dir, shards=args.shards, split=args.split, protocol=args.protocol,
        detokenizer=args.detokenizer, samples_per_block=args.samples,
        seed=args.seed, seq_len=args.seq_len, batch_size=args.batch_size, compile=args.compile,
        discrete_steps=args.discrete_steps,
        target_rel_error=args.target_rel_error, add_eos=not args.no_eos, max_documents=args.max_documents,
        blocks_per_replicate=QUICK_BLOCKS_PER_REPLICATE if args.quick else args.blocks_per_replicate)


def _cmd_eval(args: argparse.Namespace) -> int:
    # Imported when the command runs: it pulls in MLflow, which would double the start-up time of
    # every other `unmask` command.
    from evaluation.zero_shot import ReportOptions, run_zero_shot

    configure_logging()
    config = _eval_config(args)
    sampling = plan_from_args(args, REPORT_FLAGS, args.seed)
    check_samples_drawn(args, REPORT_FLAGS, args.num_samples)
    check_flags_apply(args, REPORT_FLAGS, objective_of(Path(args.path)), args.path)
    options = ReportOptions(num_samples=args.num_samples, sampling=sampling,
                            sample_sweep=args.sample_sweep, reference=Path(args.reference) if args.reference else None,
                            compare=Path(args.compare) if args.compare else None,
                            out=Path(args.out) if args.out is not None else None, mlflow_uri=args.mlflow_uri)
    report = run_zero_shot(Path(args.path), config, options, device=args.device or None)
    if report is not None:  # rank 0
        _print_summary(report.results, report.files.markdown)
    return 0


def _print_summary(results: EvalResults, report: Path) -> None:
    bound = "perplexity" if results.model.objective == "autoregressive" else "perplexity <="
    print(f"protocol: {results.protocol.name}")
    for name, record in results.datasets.items():
        low, high = record.perplexity_interval
        print(f"{name:>24}: {bound} {record.perplexity_bound:.3f} (95% {low:.3f}-{high:.3f}), "
              f"{record.nelbo_per_token:.4f} nats/token, {record.bits_per_byte:.4f} bits/byte, "
              f"{record.num_tokens:,} tokens ({record.dataset.get('split')} split)")
    suite = results.protocol.suite
    for missing in suite.missing if suite else ():
        print(f"{missing.name:>24}: not scored ({missing.split} split): {missing.expected}")
    sampling = results.sampling
    if sampling:
        print(f"{'samples':>24}: mean unigram entropy {sampling.mean_unigram_entropy:.3f} nats", end="")
        perplexity = sampling.generative_perplexity
        print(f", generative perplexity {perplexity.perplexity:.3f} under {perplexity.reference}" if perplexity
              else "")
    print(f"report: {report}")
    print(json.dumps({"mlflow_run_id": results.mlflow.run_id if results.mlflow else None, "report": str(report)}))


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``eval`` to the ``unmask`` command."""
    parser = commands.add_parser(
        "eval", help="zero-shot perplexity bounds and bits per byte -> MLflow and RUN/report/",
        description="Estimate the NELBO (an upper bound on -log p) of each dataset with K time samples "
                    "per block, report the perplexity bound with its 95%% Monte Carlo interval and bits "
                    "per byte, log them to MLflow and write RUN/report/ (report.md, report.html, "
                    "results.json, plots). AR exports get their exact perplexity.",
        epilog=EVAL_EPILOG, formatter_class=RAW)
    parser.add_argument("path", metavar="RUN_OR_EXPORT", help="a training run (exported first if needed) "
                                                              "or an export directory")
    parser.add_argument("--datasets",
                        help="comma-separated: lambada, wikitext2, wikitext103, ptb, lm1b, ag_news, pubmed, arxiv, "
                             "val, or file paths")
    parser.add_argument("--suite", choices=tuple(SUITES),
                        help=f"{ZERO_SHOT}: every set of the papers' zero-shot table (PTB, WikiText, LM1B, LAMBADA, "
                             "AG News, PubMed, ArXiv) found under --data-dir, the missing ones named; the report "
                             "puts the table beside the published rows (instead of --datasets)")
    parser.add_argument("--data-dir", help="root of the standard files (layout of ../shared/data)")
    parser.add_argument("--shards", help="training shards (for the val dataset)")
    parser.add_argument("--split", help="test or valid (default: the protocol's; test for ours)")
    parser.add_argument("--protocol", choices=tuple(PROTOCOLS), default=DEFAULT_PROTOCOL,
                        help="how the sets become scored blocks: unmask (ours: test split, EOS per document, "
                             "nothing dropped); mdlm (MDLM's code: its splits, rows and detokenizers, an EOS per row, "
                             "BOS/EOS around every block of 1024); bd3lm (BD3-LM's zero-shot scripts: no EOS between "
                             "rows, the BOS not scored); duo (Duo's scripts and MDLM's paper: no EOS between rows) "
                             "(default: %(default)s)")
    parser.add_argument("--detokenizer", choices=tuple(DETOKENIZERS),
                        help="for every text dataset instead of the protocol's (e.g. lambada_gpt2)")
    parser.add_argument("--samples", type=int, default=16, help="time samples per block K (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, help="block length (default: the protocol's; ours: the model's "
                                                    "training length, mdlm: 1024)")
    parser.add_argument("--batch-size", type=int, help="blocks per forward pass (default: sized to the device: "
                                                       "16 on CPU, the largest the GPU's memory fits up to 256)")
    parser.add_argument("--compile", choices=COMPILE_SETTINGS, default="auto",
                        help="torch.compile the network (for the bound and the report's samples): auto does on "
                             "a GPU when a rank scores (or the samples pass) 32M tokens or more (compiling takes "
                             "about half a minute) (default: %(default)s)")
    parser.add_argument("--discrete-steps", type=int, help="report the T-step discrete bound instead")
    parser.add_argument("--target-rel-error", type=float,
                        help="add samples until the standard error is this fraction of the bound")
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS to each document")
    parser.add_argument("--max-documents", type=int, help="only the first N documents (quick looks)")
    parser.add_argument("--blocks-per-replicate", type=int, metavar="N",
                        help="each time sample scores a random N of the blocks: the whole set's bound with an "
                             "honest, wider interval at a cost that does not grow with the set")
    parser.add_argument("--quick", action="store_true",
                        help=f"--blocks-per-replicate {QUICK_BLOCKS_PER_REPLICATE}: minutes on a CPU for any "
                             "dataset, an interval a few times wider")
    samples = parser.add_argument_group("samples in the report")
    samples.add_argument("--num-samples", type=int, default=0, help="also generate N samples for the report "
                         "(seeded by --seed)")
    add_sampling_arguments(samples, REPORT_FLAGS)
    samples.add_argument("--sample-sweep", action="store_true",
                         help="also N samples from every sampler at 16 to 1024 network calls: a quality table and "
                              "plot in the report (generative perplexity with --reference)")
    parser.add_argument("--reference", metavar="PATH",
                        help="an autoregressive model that scores the samples (generative perplexity): an unmask "
                             "AR export or run, or a Hugging Face causal LM directory (needs transformers)")
    parser.add_argument("--compare", metavar="RESULTS_JSON",
                        help="another evaluation's results.json (e.g. the AR baseline's): the report "
                             "shows the gap on the datasets both scored")
    parser.add_argument("--out", help="report directory, new or empty or an earlier report (default RUN/report)")
    parser.add_argument("--mlflow-uri", help="log to this server in a new run (default: the training's run)")
    parser.add_argument("--device", help=f"{DEVICE_HELP}; under torchrun, this rank's GPU")
    parser.set_defaults(handler=_cmd_eval)
