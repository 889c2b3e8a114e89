"""``unmask run``: prep -> train -> export -> eval (with its report), in one run directory.

Each stage calls its library (``data_prep.prep``, ``pipeline.training.trainer.train`` or
``orchestration.cluster.ray_train.launch``, ``pipeline.interchange.export.export``,
``evaluation.zero_shot``) in this process with the typed request below, and is skipped when its
output is up to date (docs/concepts.md, "Concepts": the table's last column), so rerunning a
finished run does nothing and rerunning a failed or killed one continues where it stopped. The
run directory is claimed as a run's (``common.outputs``) before any stage. A train stage
stopped by SIGTERM or SIGINT raises ``Preempted`` instead of going on to the export, and
``unmask run`` exits with ``orchestration.exit_codes.PREEMPTED``. With no inputs the corpus is
the documentation text shipped with CPython (``data_prep.builtin_corpus``) and the config
``configs/demo.yaml``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from common.atomic_files import atomic_write_bytes
from common.errors import UserError
from common.outputs import InputPath, claim_output_dir, json_object, refuse_links
from data_prep.builtin_corpus import write_cpython_corpus
from data_prep.prep import PrepRequest, prep
from data_prep.readers import ReadOptions, local_roots
from data_prep.write_shards import DEFAULT_VAL_FRACTION, MAX_SEQ_LEN, PrepConfig
from evaluation.bounds.scoring import ScoringConfig
from evaluation.generation.generate import check_sampling
from evaluation.results import EvalResults, TrainingRecord
from evaluation.zero_shot import ReportOptions, is_up_to_date, run_zero_shot
from model.sampling import SamplingPlan
from model.transformer import PRESETS
from orchestration.cluster.ray_train import RayLaunch, launch
from pipeline.config import Config
from pipeline.interchange.export import CONFIG_FILE, damaged_export, export, verify_export
from pipeline.run_dir.checkpoint import latest_step
from pipeline.run_dir.layout import RUN_KIND, RunLayout
from pipeline.training.hooks import TrainHooks
from pipeline.training.init_from import InitFrom, init_inputs, recorded_source
from pipeline.training.trainer import train

__all__ = ["RunRequest", "EvalStage", "RunSummary", "Preempted", "run_pipeline", "DEMO_CONFIG"]

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
# The built-in corpus is small (about 0.4M tokens): prep's default 0.5% would leave a handful
# of validation sequences, too few for a stable bound.
BUILTIN_VAL_FRACTION = 0.05
SUMMARY_METRICS = ("nelbo_per_token", "perplexity_bound", "bits_per_byte")


@dataclass(frozen=True)
class EvalStage:
    """What the eval stage scores and puts in the report."""

    datasets: tuple[str, ...] = ("val",)     # "val": the held-out split of RUN/data
    data_dir: str | None = None              # root of the standard eval files
    samples_per_block: int = 16
    num_samples: int = 2                     # generated samples in the report
    sampling: SamplingPlan = SamplingPlan()  # how they are drawn
    blocks_per_replicate: int | None = None  # a quick look: see ScoringConfig


@dataclass(frozen=True)
class RunRequest:
    """What ``unmask run`` was asked to do: the config (loaded once), the data and the stages."""

    run_dir: Path
    config: Config
    inputs: tuple[str, ...] = ()             # empty: the built-in CPython corpus
    read: ReadOptions = ReadOptions()
    seq_len: int | None = None               # None: model.max_seq_len or the preset's
    val_fraction: float | None = None        # None: prep's default (BUILTIN_VAL_FRACTION for the demo)
    tokenizer: str | None = None             # None: train a sentencepiece tokenizer of vocab_size
    vocab_size: int = 4096
    prep_workers: int = 1
    ray_address: str | None = None           # the cluster of prep (and of the Ray launcher)
    launch: RayLaunch | None = None          # None: train in this process
    init_from: InitFrom | None = None        # the weights a new run starts from (pipeline.training.init_from)
    evaluation: EvalStage = EvalStage()

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run_dir)

    def check(self) -> None:
        """The flags that later stages read, before the first stage starts: a bad dataset, sample
        count or sampling plan (a sampler the config's process does not take, a budget past its
        limits) must not wait for the end of a training."""
        evaluation = self.evaluation
        checks = [("--prep-workers", self.prep_workers >= 1, "must be >= 1"),
                  ("--seq-len", self.seq_len is None or 2 <= self.seq_len <= MAX_SEQ_LEN,
                   f"must lie in [2, {MAX_SEQ_LEN}] (data_prep.write_shards.MAX_SEQ_LEN)"),
                  ("--val-fraction", self.val_fraction is None or 0 <= self.val_fraction < 1,
                   "must lie in [0, 1)"),
                  ("--num-samples", evaluation.num_samples >= 0, "must be >= 0")]
        for flag, ok, requirement in checks:
            if not ok:
                raise UserError(f"{flag} {requirement}")
        if self.launch is not None:
            self.launch.check()
        self.eval_config().check(shards_pending=True)
        if evaluation.num_samples:  # the samples of the report, against the model the config describes
            model = self.config.model
            check_sampling(evaluation.sampling, objective=model.objective, process=model.process,
                           max_seq_len=model.max_seq_len or _seq_len(self), steps_flag="--sample-steps",
                           block_size=model.block_size)

    def eval_config(self) -> ScoringConfig:
        evaluation = self.evaluation
        return ScoringConfig(datasets=evaluation.datasets, data_dir=evaluation.data_dir, shards=str(self.layout.data),
                          samples_per_block=evaluation.samples_per_block,
                          blocks_per_replicate=evaluation.blocks_per_replicate)

    def report_options(self) -> ReportOptions:
        return ReportOptions(num_samples=self.evaluation.num_samples, sampling=self.evaluation.sampling)

    def reads(self) -> list[InputPath]:
        """What the run reads from outside its directory, which the directory keeps clear of."""
        tokenizer = [InputPath(self.tokenizer, "--tokenizer")] if self.tokenizer else []
        inputs = [InputPath(root, "--input") for root in local_roots(self.inputs)]
        return inputs + tokenizer + init_inputs(self.init_from)


class Preempted(Exception):
    """The train stage stopped on a signal after writing its checkpoint: the run goes on
    when the same request runs again."""

    def __init__(self, step: int | None) -> None:
        super().__init__(f"stage train was stopped by a signal at step {step} and wrote its checkpoint; "
                         f"rerun the same `unmask run` to continue")
        self.step = step


@dataclass(frozen=True)
class StageContext:
    """What every stage gets beside the request: where to say what it does, and the hooks of
    the training loop (tests and embedding scripts watch or pause its steps)."""

    say: Callable[[str], None] = print
    hooks: TrainHooks = TrainHooks()


@dataclass(frozen=True)
class RunSummary:
    """What ``unmask run`` did and found (``RUN/run_summary.json``)."""

    run_dir: str
    seconds: float
    stages: dict[str, str]                   # stage -> what it did, or why it was skipped
    step: int | None                         # of the evaluated export
    training: TrainingRecord | None
    datasets: dict[str, dict[str, float]]    # name -> SUMMARY_METRICS
    report: str
    mlflow: dict | None                      # tracking_uri and run_id; None when MLflow did not answer
    init_from: dict | None = None            # the source of the first weights (pipeline.training.init_from.InitRecord)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


# ------------------------------------------------------------------ the stages
def _seq_len(request: RunRequest) -> int:
    model = request.config.model
    return request.seq_len or model.max_seq_len or PRESETS[model.preset]["max_seq_len"]


def _stage_prep(request: RunRequest, context: StageContext) -> str:
    layout, say = request.layout, context.say
    inputs, val_fraction = request.inputs, request.val_fraction
    if not inputs:
        inputs = (str(write_cpython_corpus(layout.corpus)),)
        val_fraction = BUILTIN_VAL_FRACTION if val_fraction is None else val_fraction
    config = PrepConfig(inputs=inputs, seq_len=_seq_len(request), seed=request.config.train.seed,
                        val_fraction=DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction,
                        read=request.read)
    result = prep(PrepRequest(config, layout.data, tokenizer=request.tokenizer,
                              vocab_size=None if request.tokenizer else request.vocab_size,
                              workers=request.prep_workers, ray_address=request.ray_address))
    for note in result.notes():
        say(f"unmask run: note: {note}")
    for warning in result.warnings():
        say(f"unmask run: warning: {warning}")
    say(result.summary())
    return f"skipped: {layout.data} is up to date" if result.nothing_to_do else f"shards in {layout.data}"


def _stage_train(request: RunRequest, context: StageContext) -> str:
    run_dir, config = request.run_dir, request.config
    recorded_source(run_dir, request.init_from)  # refuses another source before a finished run is skipped
    step = latest_step(run_dir)
    if step is not None and step >= config.train.max_steps:
        return f"skipped: already trained to step {step}"
    config = replace(config, data=replace(config.data, path=str(request.layout.data)))
    if request.launch is None:
        preempted = train(config, data_dir=request.layout.data, run_dir=run_dir, hooks=context.hooks,
                          init_from=request.init_from).preempted
    else:
        summary = launch(config, request.launch, data_dir=request.layout.data, run_dir=run_dir,
                         on_step=context.hooks.on_step, init_from=request.init_from)
        preempted = bool(summary.get("preempted"))
    if preempted:
        raise Preempted(latest_step(run_dir))
    return f"trained to step {latest_step(run_dir)}"


def _exported_step(layout: RunLayout) -> int | None:
    """The step of the run's export; None without one. A damaged export is refused (it is
    not up to date, and exporting again would replace files that are not as written)."""
    if not (layout.export / CONFIG_FILE).is_file():
        return None
    problem = verify_export(layout.export)
    if problem is not None:
        raise damaged_export(problem, layout.export)
    return (json_object(layout.export / CONFIG_FILE) or {}).get("step")


def _stage_export(request: RunRequest, context: StageContext) -> str:
    step = latest_step(request.run_dir)
    if _exported_step(request.layout) == step:
        return f"skipped: the export holds step {step}"
    export(request.run_dir)
    return f"exported step {step} (EMA weights)"


def _stage_eval(request: RunRequest, context: StageContext) -> str:
    config, options = request.eval_config(), request.report_options()
    if is_up_to_date(request.run_dir, config, options):
        return f"skipped: {request.layout.results} is up to date"
    run_zero_shot(request.run_dir, config, options)
    return f"report in {request.layout.report}"


STAGES: tuple[tuple[str, Callable[[RunRequest, StageContext], str]], ...] = (
    ("prep", _stage_prep), ("train", _stage_train), ("export", _stage_export), ("eval", _stage_eval))


def run_pipeline(request: RunRequest, *, say: Callable[[str], None] = print,
                 hooks: TrainHooks = TrainHooks()) -> RunSummary:
    """Run every stage that is not up to date; the summary (also in ``RUN/run_summary.json``).
    A stage that fails raises (``Preempted`` for a training stopped by a signal); rerunning
    the same request continues from it. ``hooks`` run inside the training loop."""
    request.check()
    layout = request.layout
    refuse_links([*layout.pipeline_writes(), *layout.training_writes()], "--run-dir", request.run_dir)
    claim = claim_output_dir(request.run_dir, RUN_KIND, "--run-dir", request.reads())
    context = StageContext(say, hooks)
    start = time.perf_counter()
    try:
        stages = _run_stages(request, context)
    except BaseException:
        # Nothing worth keeping (the prep gave its directory back): RUN goes too, if it was new,
        # with the built-in corpus it wrote (written again in seconds).
        claim.abandon(written=[request.layout.corpus.name])
        raise
    summary = _summary(request, stages, time.perf_counter() - start)
    atomic_write_bytes(request.layout.summary, summary.to_json().encode())
    return summary


def _run_stages(request: RunRequest, context: StageContext) -> dict[str, str]:
    """Each stage in turn; what each did."""
    say, stages = context.say, {}
    for name, stage in STAGES:
        say(f"unmask run: stage {name}")
        try:
            stages[name] = stage(request, context)
        except UserError as err:
            raise UserError(f"stage {name} failed: {err}. Fix it and rerun the same `unmask run`: finished "
                            f"stages are kept and skipped") from None
        say(f"unmask run: stage {name}: {stages[name]}")
    return stages


def _summary(request: RunRequest, stages: dict[str, str], seconds: float) -> RunSummary:
    results = EvalResults.read(request.layout.results)
    datasets = {name: {key: getattr(record, key) for key in SUMMARY_METRICS}
                for name, record in results.datasets.items()}
    mlflow = results.mlflow.to_json() if results.mlflow else None
    recorded = recorded_source(request.run_dir, None)
    return RunSummary(run_dir=str(request.run_dir), seconds=round(seconds, 1), stages=stages,
                      step=results.model.step, training=results.training or None, datasets=datasets,
                      report=str(request.layout.report / "report.html"), mlflow=mlflow,
                      init_from=recorded.to_json() if recorded else None)
