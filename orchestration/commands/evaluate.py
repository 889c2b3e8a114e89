"""The ``unmask eval`` command: bounds per dataset -> MLflow and ``RUN/report/``."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
from pathlib import Path

from common.errors import UserError, output_dir
from common.logs import configure_logging
from common.provenance import git_commit, package_version

RAW = argparse.RawDescriptionHelpFormatter
log = logging.getLogger("unmask.eval")

EVAL_EPILOG = """\
examples:
  unmask eval runs/tiny --datasets ptb,wikitext2,lambada,lm1b --data-dir ../shared/data
  unmask eval runs/tiny --datasets val --shards shards/ --samples 32
  unmask eval runs/m/export --datasets wikitext103 --data-dir data/ --target-rel-error 0.002
  torchrun --nproc-per-node 8 -m orchestration.cli eval runs/m --datasets lambada,ptb --data-dir data/
"""
REPORT_DIR = "report"
VAL_METRIC = "val/nelbo_per_token"
CURVE_METRICS = ("train/loss", VAL_METRIC)


def _export_if_missing(path: Path) -> None:
    """A training run without an export is exported first: its latest checkpoint's EMA
    weights, or its live weights when the checkpoint has no EMA (with a warning)."""
    from pipeline.checkpoint import CHECKPOINTS_DIR, resolve_checkpoint
    from pipeline.export import CONFIG_FILE, EXPORT_DIR, export, has_ema

    if not (path / CHECKPOINTS_DIR).is_dir() or (path / EXPORT_DIR / CONFIG_FILE).is_file():
        return
    weights = "ema" if has_ema(resolve_checkpoint(path)) else "model"
    if weights == "model":
        log.warning("%s: the latest checkpoint has no EMA; evaluating its live weights", path)
    log.info("%s has no export yet: exporting its latest checkpoint (%s weights)", path, weights)
    export(path, weights=weights)


def _model_record(export_dir: Path, exported) -> dict:
    config = exported.config
    weights = ("EMA weights (decay {})".format(config.get("ema_decay")) if config.get("weights") == "ema"
               else "live weights (no EMA: exported with --weights model)")
    return {"path": str(export_dir.resolve()), "objective": config["objective"], "step": config.get("step"),
            "tokens_seen": config.get("tokens_seen"), "weights": config.get("weights"), "weights_note": weights,
            "network": dict(config["network"]),
            "tokenizer": {"kind": exported.tokenizer.kind, "sha256": exported.tokenizer.sha256,
                          "vocab_size": exported.tokenizer.vocab_size}}


def _training_record(run_dir: Path) -> dict | None:
    """The training's validation bound at step 0 (untrained) and at its last validation."""
    from pipeline.trainer import CONFIG_FILE, METRICS_FILE

    path = run_dir / METRICS_FILE
    if not path.is_file():
        return None
    validations = [(record["step"], record[VAL_METRIC]) for line in path.read_text().splitlines()
                   if line.strip() and VAL_METRIC in (record := json.loads(line))]
    if not validations or validations[0][0] != 0:
        return None
    config = json.loads((run_dir / CONFIG_FILE).read_text())
    return {"untrained_val_nelbo_per_token": validations[0][1], "final_step": validations[-1][0],
            "final_val_nelbo_per_token": validations[-1][1], "val_split": config["data"]["val_split"]}


def _tracker(run_dir: Path | None, out_dir: Path, uri: str | None, model: dict):
    """The training's MLflow run when known; else a new run (tagged with the checkpoint)."""
    from pipeline.tracking import Tracker

    tracker = Tracker.attach(run_dir) if run_dir is not None and uri is None else None
    if tracker is None:
        tracker = Tracker.open(out_dir, tracking_uri=uri, experiment="unmask-eval")
        tracker.set_tags({"checkpoint": model["path"], "step": str(model["step"])})
    return tracker


def _log_metrics(tracker, results: dict) -> None:
    step = results["model"]["step"] or 0
    for name, record in results["datasets"].items():
        key = name.replace("/", "_")
        tracker.log_metrics({f"eval/{key}/nelbo_per_token": record["nelbo_per_token"],
                             f"eval/{key}/perplexity_bound": record["perplexity_bound"],
                             f"eval/{key}/bits_per_byte": record["bits_per_byte"],
                             f"eval/{key}/standard_error": record["standard_error"]}, step)


def _cmd_eval(args: argparse.Namespace) -> int:
    from evaluation.evaluate import EvalConfig, evaluate
    from evaluation.generation import _device as checked_device
    from pipeline.distributed import init_distributed
    from pipeline.export import load_export, resolve_export, training_run_of

    configure_logging()
    config = EvalConfig(
        datasets=tuple(name.strip() for name in args.datasets.split(",") if name.strip()),
        data_dir=args.data_dir, shards=args.shards, split=args.split, samples_per_block=args.samples,
        seed=args.seed, seq_len=args.seq_len, batch_size=args.batch_size, discrete_steps=args.discrete_steps,
        target_rel_error=args.target_rel_error, add_eos=not args.no_eos, max_documents=args.max_documents)
    config.check()  # the flags and every dataset, before any work
    if args.num_samples < 0 or args.sample_steps < 1:
        raise UserError(f"--num-samples must be >= 0 and --sample-steps >= 1, got {args.num_samples} and "
                        f"{args.sample_steps}")
    if args.out is not None:
        output_dir(args.out, "--out")
    if args.compare:
        _read_compare(Path(args.compare), config.datasets)
    requested_device = checked_device(args.device) if args.device else None
    dist = init_distributed(deepspeed_backend=False)
    if dist.is_main:
        _export_if_missing(Path(args.path))
    dist.barrier()
    export_dir = resolve_export(args.path)
    run_dir = training_run_of(export_dir)
    exported = load_export(export_dir)
    device = requested_device or dist.device
    results = evaluate(exported, config, device=device, rank=dist.rank, world_size=dist.world_size,
                       all_reduce=dist.sum, progress=lambda m: log.info(m) if dist.is_main else None)
    if dist.is_main:
        out_dir = Path(args.out) if args.out else (run_dir or export_dir) / REPORT_DIR
        _finish(results, exported, export_dir, run_dir, out_dir, args)
    dist.shutdown()
    return 0


def _finish(results: dict, exported, export_dir: Path, run_dir: Path | None, out_dir: Path,
            args: argparse.Namespace) -> None:
    """Rank 0: samples, MLflow, report files, summary."""
    from evaluation.report import write_report

    results["model"] = _model_record(export_dir, exported)
    if run_dir is not None:
        results["training"] = _training_record(run_dir)
    if args.compare:
        results["comparison"] = _comparison(Path(args.compare), results)
    results["samples"] = _samples(exported, args)
    results.update(created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   unmask_version=package_version("unmask"), git_commit=git_commit())
    tracker, curves = _track_results(run_dir, out_dir, args.mlflow_uri, results)
    files = write_report(results, out_dir, curves=curves)
    if tracker is not None:
        _best_effort(lambda: tracker.log_artifact(out_dir, artifact_path=REPORT_DIR), "the report")
    _print_summary(results, files.markdown)


def _track_results(run_dir: Path | None, out_dir: Path, uri: str | None, results: dict):
    """The metrics into MLflow and the training curves out of it, when the server answers.
    A tracking server that is down costs the MLflow record, never the evaluation: the
    results and the report are written either way (``results["mlflow"]`` is then None)."""
    results["mlflow"] = None
    try:
        tracker = _tracker(run_dir, out_dir, uri, results["model"])
        _log_metrics(tracker, results)
        curves = {key: tracker.metric_history(key) for key in CURVE_METRICS}
    except _tracking_errors() as err:
        log.warning("MLflow: the results were not logged (%s); they are in %s", str(err).split("; ")[0],
                    out_dir / "results.json")
        return None, None
    results["mlflow"] = {"tracking_uri": tracker.tracking_uri, "run_id": tracker.run_id}
    return tracker, {k: v for k, v in curves.items() if v} or None


def _tracking_errors() -> tuple[type[BaseException], ...]:
    """What a tracking server that is down or failing raises (imported late: MLflow is slow to import)."""
    from mlflow.exceptions import MlflowException

    from pipeline.tracking import TrackingUnreachable

    return TrackingUnreachable, MlflowException, OSError


def _best_effort(action, what: str) -> None:
    try:
        action()
    except _tracking_errors() as err:
        log.warning("MLflow: %s was not uploaded (%s)", what, str(err).split("; ")[0])


def _read_compare(path: Path, names: tuple[str, ...] | None = None) -> tuple[dict, dict]:
    """The model and dataset records of another evaluation's results.json; with ``names``
    (checked before any work), it must have scored one of them."""
    try:
        other = json.loads(path.read_text())
        model, datasets = other["model"], other["datasets"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"--compare {path}: not the results.json of an `unmask eval` ({err})") from None
    # Names as given, without the " (first N documents)" that --max-documents adds.
    if names is not None and not set(names) & {name.split(" (first ")[0] for name in datasets}:
        raise UserError(f"--compare {path}: it scored {sorted(datasets)}, none of --datasets {','.join(names)}")
    return model, datasets


def _comparison(path: Path, results: dict) -> dict:
    """Another evaluation's results (e.g. the AR baseline's) on the datasets both scored."""
    model, datasets = _read_compare(path)
    shared = {name: datasets[name] for name in results["datasets"] if name in datasets}
    if not shared:
        raise UserError(f"--compare {path}: it scored {sorted(datasets)}, none of {sorted(results['datasets'])}")
    return {"model": model, "datasets": shared, "path": str(path.resolve())}


def _samples(exported, args: argparse.Namespace) -> list[dict]:
    if not args.num_samples:
        return []
    from evaluation.generation import generate

    samples = generate(exported, num=args.num_samples, steps=args.sample_steps, seed=args.seed)
    return [{"text": s.text, "network_calls": s.network_calls, "steps": s.steps} for s in samples]


def _print_summary(results: dict, report: Path) -> None:
    bound = "perplexity" if results["model"]["objective"] == "autoregressive" else "perplexity <="
    for name, record in results["datasets"].items():
        low, high = record["perplexity_interval"]
        print(f"{name:>24}: {bound} {record['perplexity_bound']:.3f} (95% {low:.3f}-{high:.3f}), "
              f"{record['nelbo_per_token']:.4f} nats/token, {record['bits_per_byte']:.4f} bits/byte, "
              f"{record['num_tokens']:,} tokens")
    print(f"report: {report}")
    print(json.dumps({"mlflow_run_id": (results["mlflow"] or {}).get("run_id"), "report": str(report)}))


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
    parser.add_argument("--datasets", required=True,
                        help="comma-separated: lambada, wikitext2, wikitext103, ptb, lm1b, val, or file paths")
    parser.add_argument("--data-dir", help="root of the standard files (layout of ../shared/data)")
    parser.add_argument("--shards", help="training shards (for the val dataset)")
    parser.add_argument("--split", default="test", help="test or valid (default test)")
    parser.add_argument("--samples", type=int, default=16, help="time samples per block K (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, help="block length (default: the model's training length)")
    parser.add_argument("--batch-size", type=int, default=16, help="blocks per forward pass")
    parser.add_argument("--discrete-steps", type=int, help="report the T-step discrete bound instead")
    parser.add_argument("--target-rel-error", type=float,
                        help="add samples until the standard error is this fraction of the bound")
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS to each document")
    parser.add_argument("--max-documents", type=int, help="only the first N documents (quick looks)")
    parser.add_argument("--num-samples", type=int, default=0, help="also generate N samples for the report")
    parser.add_argument("--sample-steps", type=int, default=1000, help="sampling steps (default 1000)")
    parser.add_argument("--compare", metavar="RESULTS_JSON",
                        help="another evaluation's results.json (e.g. the AR baseline's): the report "
                             "shows the gap on the datasets both scored")
    parser.add_argument("--out", help="report directory (default RUN/report)")
    parser.add_argument("--mlflow-uri", help="log to this server in a new run (default: the training's run)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 (default: this rank's device)")
    parser.set_defaults(handler=_cmd_eval)
