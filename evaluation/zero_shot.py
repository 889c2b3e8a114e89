"""Zero-shot evaluation of a training run or an export, end to end: the library behind
``unmask eval`` and the eval stage of ``unmask run``.

    config = ScoringConfig(datasets=("ptb", "val"), data_dir="../shared/data", shards="shards/")
    report = run_zero_shot(Path("runs/tiny"), config, ReportOptions(num_samples=2))
    report.results.datasets["ptb"].perplexity_bound, report.files.html

In order: every argument is checked before any work (the report's directory included, nothing
is created until the report is written); a training run without an export is exported first;
every rank scores every dataset (``evaluation.bounds.scoring``); rank 0 adds the records,
samples with their quality, MLflow, and writes the report (``evaluation.report.write``). When
the samples fail, the report of the bounds is written before the error is raised. Under
torchrun every rank calls ``run_zero_shot`` and ranks other than 0 return None; without a
``dist`` it joins the launcher's process group and leaves it at the end. ``is_up_to_date``
lets ``unmask run`` skip the stage. See docs/evaluation.md.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from common.errors import UserError
from common.outputs import InputPath, check_output_dir, json_object
from common.provenance import git_commit, package_version
from data_prep.shards.format import MANIFEST_NAME
from evaluation.bounds.scoring import VAL_DATASET, Scores, ScoringConfig, score_datasets, with_suite
from evaluation.generation.generate import check_plan, generate
from evaluation.generation.sample_quality import ReferenceModel, check_reference, load_reference, score_samples
from evaluation.generation.sampler_sweep import sampler_sweep, sweep_samplers
from evaluation.inference import resolve_device
from evaluation.report.results_tracking import VAL_METRIC, track_results
from evaluation.report.write import JSON_NAME, REPORT_KIND, ReportFiles, read_record, write_report
from evaluation.results import (
    ABSENT,
    DOWNSTREAM_JSON,
    Absent,
    Comparison,
    DatasetResult,
    DownstreamResults,
    EvalResults,
    ModelRecord,
    SampleRecord,
    SamplingRecord,
    ScheduleRecord,
    ScheduleToken,
    SweepRow,
    TokenizerRecord,
    TrainingRecord,
)
from model.learned import LearnedDiffusion, exponent_spread
from model.sampling import SamplingPlan
from pipeline.distributed import Distributed, init_distributed
from pipeline.interchange.export import (
    CONFIG_FILE,
    Exported,
    export_files,
    load_export,
    resolve_export,
    training_run_of,
)
from pipeline.interchange.run_export import choose_export
from pipeline.run_dir.layout import RunLayout

__all__ = ["ReportOptions", "ZeroShotReport", "check_report_dir", "is_up_to_date", "model_record", "report_dir",
           "run_zero_shot"]

log = logging.getLogger("unmask.eval")
# Token values listed as unmasking first and last in a learned schedule's record (seed 002 shows 10-12).
SCHEDULE_TOKENS = 10



@dataclass(frozen=True)
class ReportOptions:
    """What the report holds beside the bounds, and where it goes."""

    num_samples: int = 0            # samples generated for the report
    sampling: SamplingPlan = SamplingPlan()  # how they are drawn
    sample_sweep: bool = False      # also every sampler at every budget (evaluation.generation.sampler_sweep)
    reference: Path | None = None   # an AR model that scores them (generative perplexity)
    compare: Path | None = None     # another evaluation's results.json: the report shows the gap
    out: Path | None = None         # None: RUN/report, or EXPORT/report for a standalone export
    mlflow_uri: str | None = None   # None: the training's own MLflow run (a new run without one)

    def check(self) -> None:
        """The sample flags and the reference (the report's directory is checked with what the
        evaluation reads, ``run_zero_shot``): a UserError naming the flag."""
        if self.num_samples < 0:
            raise UserError(f"--num-samples must be >= 0, got {self.num_samples}")
        if self.sample_sweep and not self.num_samples:
            raise UserError("--sample-sweep draws --num-samples N samples per sampler and budget: give N too")
        if self.reference is not None:
            if not self.num_samples:
                raise UserError("--reference scores the report's samples: give --num-samples N too")
            check_reference(self.reference)


@dataclass(frozen=True)
class ZeroShotReport:
    """What ``run_zero_shot`` made: the results and the files of their report."""

    results: EvalResults
    files: ReportFiles


# ------------------------------------------------------------------ where the report goes
def _report_dir(export_dir: Path, out: Path | None) -> Path:
    if out is not None:
        return Path(out)
    return RunLayout(training_run_of(export_dir) or export_dir).report


def report_dir(target: Path, options: ReportOptions) -> Path:
    """Where the report of ``target`` (a training run with an export, or an export) goes."""
    return _report_dir(resolve_export(target), options.out)


def _exported_step(export_dir: Path) -> int | None:
    return (json_object(export_dir / CONFIG_FILE) or {}).get("step")


def is_up_to_date(target: Path, config: ScoringConfig, options: ReportOptions) -> bool:
    """Whether the report of ``target`` already scored its export as it is now (the same
    checkpoint step) on the datasets of ``config``, with as many time samples per block, and
    holds the samples ``options`` ask for (as many, drawn by the same plan, swept or not).
    False while ``target`` has no export or its report no readable results.json."""
    try:
        export_dir = resolve_export(target)
        results = EvalResults.read(_report_dir(export_dir, options.out) / JSON_NAME)
    except (UserError, OSError, ValueError):
        return False
    return (results.model.step == _exported_step(export_dir)
            and sorted(results.datasets) == sorted(config.datasets)
            and results.protocol.samples_per_block == config.samples_per_block
            and (results.protocol.blocks_per_replicate or None) == config.blocks_per_replicate
            and results.protocol.name == config.protocol
            and _holds_the_samples(results, options))


def _holds_the_samples(results: EvalResults, options: ReportOptions) -> bool:
    if not options.num_samples:
        return True
    sampling = results.sampling
    return (bool(sampling) and sampling.num_samples == options.num_samples and sampling.plan == options.sampling
            and bool(sampling.sweep) == options.sample_sweep)


# ------------------------------------------------------------------ before the work
def check_report_dir(target: Path, out: Path | None, inputs: Sequence[InputPath] = ()) -> None:
    """The directory the report of ``target`` goes to (``out``, else its default place), before
    any work (module docstring): ``target`` must be a training run or an export, and the report
    keep clear of the files the evaluation reads (the export, the run's checkpoints, ``inputs``)."""
    layout = RunLayout(target)
    reads = [InputPath(path, "the export it evaluates") for path in export_files(target)]
    if layout.is_training_run():
        reads.append(InputPath(layout.checkpoints, "the checkpoints of the run it evaluates"))
    if out is None:  # the default place depends on what the target is, which it must be
        out = _report_dir(layout.export if layout.is_training_run() else resolve_export(target), None)
    check_output_dir(out, REPORT_KIND, "--out", [*reads, *inputs])


def _check_report_dir(target: Path, config: ScoringConfig, options: ReportOptions) -> None:
    reads = [InputPath(path, flag) for flag, path in
             (("--shards", config.shards), ("--reference", options.reference), ("--compare", options.compare))
             if path is not None]
    check_report_dir(target, options.out, reads)


def _read_comparison(path: Path, names: tuple[str, ...]) -> Comparison:
    """Another evaluation's results.json (``--compare``), checked before any work: it must be
    one, whole, and have scored one of ``names``."""
    try:
        data = json.loads(path.read_text())
        scored = sorted(data["datasets"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"--compare {path}: not the results.json of an `unmask eval` ({err})") from None
    # Names as given, without the " (first N documents)" that --max-documents adds.
    if not set(names) & {name.split(" (first ")[0] for name in scored}:
        raise UserError(f"--compare {path}: it scored {scored}, none of --datasets {','.join(names)}")
    missing = EvalResults.missing(data)
    if missing:
        raise UserError(f"--compare {path}: not the results.json of an `unmask eval` (it lacks "
                        f"{', '.join(missing)}); rerun `unmask eval` to write it anew")
    other = EvalResults.from_json(data)
    return Comparison(model=other.model, datasets=other.datasets, path=str(path.resolve()))


# ------------------------------------------------------------------ the records of rank 0
def model_record(export_dir: Path, exported: Exported) -> ModelRecord:
    """The record of the export at ``export_dir``: where, what, which weights."""
    config = exported.config
    weights_note = config.get("weights_note") or (  # an imported export describes its own weights
        "EMA weights (decay {})".format(config.get("ema_decay")) if config.get("weights") == "ema"
        else "live weights (no EMA: exported with --weights model)")
    tokenizer = exported.tokenizer
    return ModelRecord(path=str(export_dir.resolve()), objective=config["objective"], step=config.get("step"),
                       tokens_seen=config.get("tokens_seen"), weights=config.get("weights"),
                       weights_note=weights_note, init_from=_init_from(config), network=dict(config["network"]),
                       tokenizer=TokenizerRecord(kind=tokenizer.kind, sha256=tokenizer.sha256,
                                                 vocab_size=tokenizer.vocab_size))


def _init_from(config: dict) -> dict | Absent:
    """The export's --init-from source (without its network: the model's own is in the record), if any."""
    source = config.get("init_from")
    return ABSENT if not source else {key: value for key, value in source.items() if key != "network"}


def _training_record(run_dir: Path, step: int | None) -> TrainingRecord | None:
    """The training's validation bound at step 0 (untrained) and at its last validation up to
    ``step``, the export's (an older checkpoint's export is not set beside later validations)."""
    layout = RunLayout(run_dir)
    path = layout.metrics
    if not path.is_file():
        return None
    validations = [(record["step"], record[VAL_METRIC]) for line in path.read_text().splitlines()
                   if line.strip() and VAL_METRIC in (record := json.loads(line))
                   and (not isinstance(step, int) or record["step"] <= step)]
    if not validations or validations[0][0] != 0:
        return None
    config = json.loads(layout.config.read_text())
    return TrainingRecord(untrained_val_nelbo_per_token=validations[0][1], final_step=validations[-1][0],
                          final_val_nelbo_per_token=validations[-1][1], val_split=config["data"]["val_split"])


def _shared(comparison: Comparison, scored: dict[str, DatasetResult], flag_path: Path | None) -> Comparison:
    """The comparison on the datasets both evaluations scored (the names must match exactly)."""
    shared = {name: comparison.datasets[name] for name in scored if name in comparison.datasets}
    if not shared:
        raise UserError(f"--compare {flag_path}: it scored {sorted(comparison.datasets)}, none of {sorted(scored)}")
    return replace(comparison, datasets=shared)


def _samples(exported: Exported, options: ReportOptions,
             device: torch.device) -> tuple[tuple[SampleRecord, ...], SamplingRecord | Absent]:
    """The report's samples with their quality, and how they were drawn (none without --num-samples)."""
    if not options.num_samples:
        return (), ABSENT
    plan = options.sampling
    samples = generate(exported, plan, num=options.num_samples, device=str(device))
    reference = load_reference(options.reference, device=device) if options.reference else None
    quality = score_samples(samples, exported.tokenizer, reference)
    records = tuple(SampleRecord(text=s.text, network_calls=s.network_calls, unigram_entropy=score.unigram_entropy,
                                 reference_nll=ABSENT if score.reference_nll is None else score.reference_nll,
                                 reference_tokens=ABSENT if score.reference_tokens is None else score.reference_tokens)
                    for s, score in zip(samples, quality.scores))
    sampling = SamplingRecord(num_samples=len(samples), plan=plan, seq_len=len(samples[0].tokens),
                              mean_unigram_entropy=quality.mean_unigram_entropy,
                              mean_network_calls=sum(s.network_calls for s in samples) / len(samples),
                              generative_perplexity=quality.generative_perplexity or ABSENT,
                              sweep=_sweep(exported, options, reference, device))
    return records, sampling


def _sweep(exported: Exported, options: ReportOptions, reference: ReferenceModel | None,
           device: torch.device) -> tuple[SweepRow, ...] | Absent:
    if not options.sample_sweep:
        return ABSENT
    return tuple(sampler_sweep(exported, options.sampling, reference, num=options.num_samples, device=str(device)))


def _schedule_record(exported: Exported) -> ScheduleRecord | Absent:
    """A learned schedule's exponents (the export's EMA theta): their spread and the
    ``SCHEDULE_TOKENS`` token values that unmask first and last, decoded; absent otherwise."""
    process = exported.process(validate=False)
    if not isinstance(process, LearnedDiffusion):
        return ABSENT
    spread = exponent_spread(process.schedule.exponents(), SCHEDULE_TOKENS)

    def tokens(entries: tuple[tuple[int, float], ...]) -> tuple[ScheduleToken, ...]:
        return tuple(ScheduleToken(token=v, text=exported.tokenizer.decode([v]), exponent=w) for v, w in entries)

    return ScheduleRecord(exponent_min=spread.minimum, exponent_median=spread.median, exponent_max=spread.maximum,
                          unmask_first=tokens(spread.first), unmask_last=tokens(spread.last))


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _report(scores: Scores, exported: Exported, export_dir: Path, comparison: Comparison | None,
            config: ScoringConfig, options: ReportOptions, device: torch.device) -> ZeroShotReport:
    """Rank 0: the records, samples, MLflow, the report files."""
    run_dir = training_run_of(export_dir)
    out_dir = _report_dir(export_dir, options.out)
    try:
        samples, sampling, failure = *_samples(exported, options, device), None
    except Exception as err:  # the bounds cost the most: their report is written before the error goes on
        samples, sampling, failure = (), ABSENT, err
    results = EvalResults(
        model=model_record(export_dir, exported), protocol=scores.protocol, datasets=scores.datasets,
        training=ABSENT if run_dir is None else _training_record(run_dir, exported.config.get("step")),
        comparison=ABSENT if comparison is None else _shared(comparison, scores.datasets, options.compare),
        samples=samples, sampling=sampling, mlflow=None, created=_now(), unmask_version=package_version("unmask"),
        git_commit=git_commit(),
        schedule=_schedule_record(exported))
    tracking = track_results(results, run_dir=run_dir, out_dir=out_dir, tracking_uri=options.mlflow_uri)
    if tracking is not None:
        results = replace(results, mlflow=tracking.record)
    files = write_report(results, out_dir, curves=tracking.curves if tracking is not None else None,
                         downstream=read_record(out_dir / DOWNSTREAM_JSON, DownstreamResults.read))
    if tracking is not None:
        tracking.upload_report(out_dir)
    if failure is not None:
        _raise_sampling_failure(failure, out_dir)
    return ZeroShotReport(results, files)


def _raise_sampling_failure(failure: Exception, out_dir: Path) -> None:
    """The samples' error, once the report of the bounds is written: the user's to fix in one line,
    anything else as it was raised (after a line that says where the bounds are)."""
    kept = f"the report of the bounds, without samples, is in {out_dir}"
    if isinstance(failure, UserError):
        raise UserError(f"the report's samples failed: {failure}; {kept}") from None
    log.error("the report's samples failed (%s: %s); %s", type(failure).__name__, failure, kept)
    raise failure


# ------------------------------------------------------------------ the entry point
def _with_the_runs_shards(target: Path, config: ScoringConfig) -> ScoringConfig:
    """``config``, with the shards of an ``unmask run`` directory (RUN/data) for the val dataset
    when none are named: the run's own held-out split."""
    data = RunLayout(target).data
    if VAL_DATASET not in config.datasets or config.shards is not None or not (data / MANIFEST_NAME).is_file():
        return config
    log.info("dataset 'val': the held-out split of %s", data)
    return replace(config, shards=str(data))


def run_zero_shot(target: Path, config: ScoringConfig, options: ReportOptions, *,
                  device: str | torch.device | None = None, dist: Distributed | None = None) -> ZeroShotReport | None:
    """Score ``target`` (a training run, exported first if needed, or an export) on the
    datasets of ``config`` and write its report; see the module docstring.

    ``device``: where this rank scores (default: the process group's device for this rank).
    ``dist``: the process group (default: joined here, and left at the end). The results and
    their files on rank 0, None on the other ranks. What the user can fix raises UserError,
    before any work when it can be known then.
    """
    target = Path(target)
    config = with_suite(_with_the_runs_shards(target, config))  # a suite: its sets under --data-dir
    config.check()  # the flags and every dataset, before any work
    options.check()
    comparison = _read_comparison(Path(options.compare), config.datasets) if options.compare else None
    requested_device = resolve_device(str(device)) if device is not None else None
    _check_report_dir(target, config, options)
    group = dist or init_distributed(deepspeed_backend=False)
    try:
        report = _score_and_report(group, target, config, options, comparison, requested_device)
    finally:  # a lone process's RANK, MASTER_PORT, ...: nothing it starts later may rendezvous on that port
        if dist is None:
            group.unset_variables()
    if dist is None:
        group.shutdown()
    return report


def _score_and_report(group: Distributed, target: Path, config: ScoringConfig, options: ReportOptions,
                      comparison: Comparison | None, requested_device: torch.device | None) -> ZeroShotReport | None:
    """``run_zero_shot``'s work in the process group: export if needed, score, write the report (rank 0)."""
    if group.is_main:  # a run's newest checkpoint, exported first where RUN/export is missing or older
        choose_export(target, refresh=True)
    group.barrier()
    export_dir = choose_export(target)
    exported = load_export(export_dir)
    if options.num_samples:  # a sampler the process does not take, a budget past its limits: before the scoring
        check_plan(exported, options.sampling, steps_flag="--sample-steps")
        if options.sample_sweep:
            sweep_samplers(exported)
    device = requested_device or group.device
    scores = score_datasets(exported, config, device=device, rank=group.rank, world_size=group.world_size,
                            all_reduce=group.sum, progress=lambda message: log.info(message) if group.is_main else None)
    return _report(scores, exported, export_dir, comparison, config, options, device) if group.is_main else None
