"""The training loop end to end (``pipeline.training.trainer``): real DeepSpeed engines on CPU
(gloo) at world sizes 1 and 2 under ZeRO 1-3, started as users start them. The same losses at
every ZeRO stage; activation checkpointing, chunked cross-entropy and bf16 through the real
trainer; the autoregressive baseline; the divergence guard; the uniform and learned processes
trained, resumed, exported, evaluated and sampled; and the tiny preset learning on
tinyshakespeare, tracked on a real MLflow server.

Resume, resharding and export of these runs are tested in ``run_dir/`` and ``interchange/``
against the same reference runs (``tests/pipeline/conftest.py``)."""

from __future__ import annotations

import json
import math
import signal

import pytest
import torch
from mlflow.tracking import MlflowClient

from data_prep.shards.format import Manifest
from model.learned import LearnedDiffusion
from model.uniform import UniformDiffusion
from pipeline.interchange.export import export, load_export
from pipeline.run_dir.checkpoint import resolve_checkpoint
from pipeline.run_dir.rank_files import rank_file
from pipeline.run_dir.safe_load import load_torch_file
from tests.support.cli_runner import run_unmask
from tests.support.reference_runs import load_export_of
from tests.support.train_helpers import run_train, run_until_stall, write_config

pytestmark = pytest.mark.slow

PROCESSES = {"uniform": UniformDiffusion, "learned": LearnedDiffusion}
EXPONENT_METRICS = ("schedule/exponent_min", "schedule/exponent_median", "schedule/exponent_max")
QUICK = ["--max-documents", "40", "--samples", "4", "--batch-size", "8"]

# Nats per token the bound must fall by in 40 steps: from about log V (5.95 for V = 384,
# the untrained model) to well below it; a broken objective or optimizer stays near log V.
REQUIRED_DROP = 0.5


# ------------------------------------------------------------------ every ZeRO stage
@pytest.mark.parametrize("world", [1, 2])
def test_zero_stages_give_the_same_losses(reference_runs, world):
    stages = [stage for (w, stage) in reference_runs if w == world]
    first = reference_runs[world, stages[0]].losses()
    assert sorted(first) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(v) for v in first.values())
    for stage in stages[1:]:
        other = reference_runs[world, stage].losses()
        assert other.keys() == first.keys()
        for step in first:  # the same math; only the order of float sums differs
            assert other[step] == pytest.approx(first[step], rel=1e-5), (stage, step)


def test_bf16_keeps_fp32_master_weights_and_matches_fp32_within_bf16_tolerance(tmp_path, shards, reference_runs):
    """The GPU precision path (DeepSpeed's bf16 optimizer, fp32 master weights and gradient
    accumulation), run on CPU: the first loss is the fp32 one up to bf16 rounding, and the
    export (float32 EMA) loads."""
    config = write_config(tmp_path / "c.yaml", {"train": {"zero_stage": 1, "precision": "bf16"}})
    run = run_train(tmp_path / "run", shards, config)
    losses, reference = run.losses(), reference_runs[1, 1].losses()
    assert all(math.isfinite(v) for v in losses.values()) and losses != reference  # bf16 really ran
    assert losses[1] == pytest.approx(reference[1], rel=0.02)
    exported = load_export(export(run.run_dir))
    assert all(t.dtype == torch.float32 for t in exported.network.state_dict().values())


# ------------------------------------------------------------------ speed switches
def test_activation_checkpointing_changes_nothing_but_memory(tmp_path, shards, reference_runs):
    config = write_config(tmp_path / "c.yaml", {"train": {"zero_stage": 1, "activation_checkpointing": True}})
    run = run_train(tmp_path / "run", shards, config)
    assert run.losses() == reference_runs[1, 1].losses()
    exported = load_export_of(run.run_dir)  # parameter names lose the checkpoint wrapper's prefix
    assert exported.keys() == load_export_of(reference_runs[1, 1].run_dir).keys()


def test_chunked_cross_entropy_and_auto_checkpointing_keep_the_losses(tmp_path, shards, reference_runs):
    """The speed switches through the real trainer: "auto" resolves (off: a tiny model fits)
    and is recorded; chunked cross-entropy changes only the float summation order."""
    config = write_config(tmp_path / "c.yaml", {"train": {"zero_stage": 1, "activation_checkpointing": "auto",
                                                          "chunked_cross_entropy": 5}})
    run = run_train(tmp_path / "run", shards, config)
    assert "activation checkpointing off (auto), compile off (auto), attention flash (auto), chunked cross-entropy " \
           "5 rows" in run.output
    reference = reference_runs[1, 1].losses()
    assert run.losses().keys() == reference.keys()
    for step, loss in run.losses().items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    record = json.loads((run.run_dir / "mlflow_run.json").read_text())
    from mlflow.tracking import MlflowClient

    params = MlflowClient(record["tracking_uri"]).get_run(record["run_id"]).data.params
    assert params["resolved.activation_checkpointing"] == "false"
    assert params["train.chunked_cross_entropy"] == "5"


# ------------------------------------------------------------------ the objectives
def test_autoregressive_baseline_trains_and_its_export_reproduces_validation(tmp_path, shards):
    from data_prep.shards.loader import StreamingLoader
    from model.autoregressive import Autoregressive

    config = write_config(tmp_path / "c.yaml", {"model": {"objective": "autoregressive"}})
    run = run_train(tmp_path / "run", shards, config)
    assert all(math.isfinite(v) for v in run.losses().values())
    exported = load_export(export(run.run_dir))
    assert exported.config["objective"] == "autoregressive" and exported.network.config.causal
    # Validation scored the first 2 val batches of 2 sequences with the EMA weights; the AR
    # likelihood is exact, so the export must reproduce the logged number.
    loader = StreamingLoader(shards, "val", 2, seed=1234, shuffle=False)
    batches = [batch for _, batch in zip(range(2), loader)]
    with torch.no_grad():
        nll = sum(Autoregressive(exported.network.config.vocab_size).nll(exported.network, b).sum() for b in batches)
    tokens = sum(b.numel() for b in batches)
    assert float(nll) / tokens == pytest.approx(run.validations()[6], rel=1e-6)


def test_divergence_aborts_with_a_clear_message(tmp_path, shards):
    config = write_config(tmp_path / "c.yaml", {"optim": {"lr": 1.0e30, "warmup_steps": 0},
                                                "train": {"max_steps": 20, "max_skipped_steps": 3},
                                                "eval": {"every": 0}})
    run = run_train(tmp_path / "run", shards, config, check=False)
    assert run.returncode == 2
    assert "training diverged: 3 consecutive steps" in run.output
    assert "optim.lr" in run.output


# ------------------------------------------------------------------ the uniform and learned processes
def _config(path, process: str, **train):
    return write_config(path, {"model": {"process": process, "time_conditioning": True},
                               "train": {"zero_stage": 1, **train}})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tinyshakespeare_shards):
    """Uninterrupted 6-step runs of each process at world size 1."""
    root = tmp_path_factory.mktemp("processes")
    return {process: run_train(root / process, tinyshakespeare_shards, _config(root / f"{process}.yaml", process))
            for process in PROCESSES}


def _exported(run_dir, name: str = "export-test"):
    return load_export(export(run_dir, out_dir=run_dir / name))


def _deterministic(run) -> dict[tuple[int, str], float]:
    """The run's losses, validations and exponents by (step, metric); not its timings. A
    resumed step's last record wins."""
    return {(record["step"], key): value for record in run.metrics() for key, value in record.items()
            if key.startswith(("train/loss", "val/", "schedule/"))}


def _ema_theta(run_dir) -> torch.Tensor:
    """The EMA of theta in the latest checkpoint, reassembled from every rank's slice."""
    checkpoint = resolve_checkpoint(run_dir)
    states = [load_torch_file(path)["ema"] for path in sorted(checkpoint.glob("rank-*.pt"))]
    if not states[0]["partitioned"]:
        return states[0]["shadow"]["schedule.theta"]
    return torch.cat([state["shadow"]["schedule.theta"] for state in states])[:states[0]["shapes"]["schedule.theta"][0]]


@pytest.mark.parametrize("process", PROCESSES)
def test_each_process_trains_and_its_export_rebuilds_it(runs, process):
    run = runs[process]
    losses, validations = run.losses(), run.validations()
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in losses.values())
    assert sorted(validations) == [0, 3, 6] and all(math.isfinite(v) for v in validations.values())
    exported = _exported(run.run_dir)
    assert (exported.config["process"], exported.spec.process) == (process, process)
    rebuilt = exported.process()
    assert type(rebuilt) is PROCESSES[process]
    if process == "uniform":
        assert exported.process_state == {} and exported.config["schedule"] == "linear"
        return
    assert exported.config["schedule"] == "learned"
    assert exported.config["schedule_args"] == {"initial_exponent": 1.0, "endpoint_eps": 1e-4}
    assert rebuilt.draws == 1  # scoring takes no gradient
    # The export holds the EMA of the trained theta, and the process reads it.
    theta = exported.process_state["theta"]
    assert torch.equal(theta, _ema_theta(run.run_dir)) and torch.equal(rebuilt.schedule.theta, theta)
    assert float((rebuilt.schedule.exponents().detach() - 1.0).abs().max()) > 1e-4  # moved from the linear start


def test_the_learned_schedule_logs_its_exponents_every_step(runs):
    logged = [record for record in runs["learned"].metrics() if "train/loss" in record]
    assert [record["step"] for record in logged] == [1, 2, 3, 4, 5, 6]
    for record in logged:
        low, middle, high = (record[key] for key in EXPONENT_METRICS)
        assert 0 < low <= middle <= high
    assert logged[-1]["schedule/exponent_min"] < logged[0]["schedule/exponent_min"] < 1.0 < logged[-1][
        "schedule/exponent_max"]
    assert not any(key in record for record in runs["uniform"].metrics() for key in EXPONENT_METRICS)


def test_the_learned_schedule_resumes_exactly_after_sigkill(tmp_path, tinyshakespeare_shards, runs):
    config = _config(tmp_path / "c.yaml", "learned")
    run_dir = tmp_path / "run"
    killed = run_until_stall(run_dir, tinyshakespeare_shards, config, stall_after=5, stop=signal.SIGKILL)
    assert killed.returncode != 0
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000003"
    resumed = run_train(run_dir, tinyshakespeare_shards, config)
    assert "resumed from" in resumed.output
    reference = runs["learned"]
    assert _deterministic(resumed) == _deterministic(reference)  # equal floats, not close
    ours, theirs = _exported(run_dir), _exported(reference.run_dir)
    assert torch.equal(ours.process_state["theta"], theirs.process_state["theta"])
    for name, tensor in ours.network.state_dict().items():
        assert torch.equal(tensor, theirs.network.state_dict()[name]), name


def test_zero3_partitions_theta_on_two_ranks_and_gives_zero1s_run(tmp_path, tinyshakespeare_shards):
    """theta is a small parameter: ZeRO-3 splits it (and its EMA) between the ranks and
    gathers it for the forward of the module that holds it; the run must be ZeRO-1's."""
    runs = {stage: run_train(tmp_path / f"z{stage}", tinyshakespeare_shards,
                             _config(tmp_path / f"z{stage}.yaml", "learned", zero_stage=stage), world_size=2)
            for stage in (1, 3)}
    slices = [load_torch_file(rank_file(resolve_checkpoint(runs[3].run_dir), rank))["ema"] for rank in (0, 1)]
    assert all(state["partitioned"] for state in slices)
    vocab = slices[0]["shapes"]["schedule.theta"][0]
    assert [state["shadow"]["schedule.theta"].numel() for state in slices] == [(vocab + 1) // 2] * 2
    first, third = (_deterministic(run) for run in (runs[1], runs[3]))
    assert first.keys() == third.keys()
    for key, value in first.items():  # the same math; only the order of float sums differs
        assert third[key] == pytest.approx(value, rel=1e-5), key
    thetas = [_exported(run.run_dir).process_state["theta"] for run in (runs[1], runs[3])]
    torch.testing.assert_close(thetas[1], thetas[0], rtol=0, atol=1e-6)
    assert torch.equal(thetas[1], _ema_theta(runs[3].run_dir))


@pytest.mark.parametrize("process", PROCESSES)
def test_eval_and_sample_through_the_command_line(runs, tinyshakespeare_shards, process, tmp_path):
    run_dir = runs[process].run_dir
    proc = run_unmask(["eval", str(run_dir), "--datasets", "val", "--shards", str(tinyshakespeare_shards),
                       "--out", str(tmp_path / "report"), *QUICK])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    val = results["datasets"]["val"]
    low, high = val["perplexity_interval"]
    assert val["estimate"]["kind"] == "continuous" and val["standard_error"] > 0
    assert low < val["perplexity_bound"] < high and math.isfinite(val["bits_per_byte"])
    markdown = (tmp_path / "report" / "report.md").read_text()
    if process == "learned":
        schedule = results["schedule"]
        assert len(schedule["unmask_first"]) == len(schedule["unmask_last"]) == 10
        tokenizer = load_export(run_dir / "export").tokenizer
        for entry in schedule["unmask_first"] + schedule["unmask_last"]:
            assert entry["text"] == tokenizer.decode([entry["token"]])
        exponents = [entry["exponent"] for entry in schedule["unmask_first"]]
        assert exponents == sorted(exponents, reverse=True) and exponents[0] == schedule["exponent_max"]
        assert "## Learned schedule" in markdown
        from mlflow.tracking import MlflowClient

        record = json.loads((run_dir / "mlflow_run.json").read_text())
        tracked = MlflowClient(record["tracking_uri"]).get_run(record["run_id"]).data
        assert tracked.metrics["eval/schedule/exponent_max"] == pytest.approx(schedule["exponent_max"])
        assert repr(schedule["unmask_first"][0]["text"]) in tracked.tags["eval/schedule/unmask_first"]
    else:
        assert "schedule" not in results and "Learned schedule" not in markdown
    sampled = run_unmask(["sample", str(run_dir), "--num", "2", "--steps", "16", "--seq-len", "32",
                          "--prompt", "ROMEO:"])
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert sampled.stdout.count("ROMEO:") == 2


# ------------------------------------------------------------------ learning
def test_tiny_learns_and_reports_to_an_mlflow_server(tmp_path, tinyshakespeare_shards, mlflow_server):
    config = write_config(tmp_path / "tiny.yaml", {
        "model": {"preset": "tiny", "n_layers": None, "d_model": None, "n_heads": None},
        "train": {"max_steps": 40, "global_batch_size": 16, "micro_batch_size": None, "ema_decay": 0.9},
        "optim": {"lr": 2.0e-3, "warmup_steps": 5, "decay": "cosine"},
        "eval": {"every": 20, "batches": 4}, "checkpoint": {"every": 40}, "logging": {"every": 5}})
    run = run_train(tmp_path / "run", tinyshakespeare_shards, config, extra=["--mlflow-uri", mlflow_server])
    bounds = run.validations()
    assert sorted(bounds) == [0, 20, 40]
    assert bounds[40] < bounds[0] - REQUIRED_DROP, bounds

    record = json.loads((run.run_dir / "mlflow_run.json").read_text())
    assert record["tracking_uri"] == mlflow_server
    client = MlflowClient(tracking_uri=mlflow_server)
    tracked = client.get_run(record["run_id"])
    assert tracked.info.status == "FINISHED"
    assert tracked.data.params["model.preset"] == "tiny" and tracked.data.params["optim.lr"] == "0.002"
    assert tracked.data.tags["data_manifest_sha256"] == Manifest.read(tinyshakespeare_shards).sha256()
    assert len(tracked.data.tags["git_commit"]) in (40, len("unknown"))
    val = client.get_metric_history(record["run_id"], "val/nelbo_per_token")
    assert {m.step: m.value for m in val} == bounds
    loss_steps = sorted(m.step for m in client.get_metric_history(record["run_id"], "train/loss"))
    assert loss_steps == [5, 10, 15, 20, 25, 30, 35, 40]
    for key in ("train/lr", "train/grad_norm", "train/tokens_per_second", "train/step_time", "val/bits_per_byte"):
        assert key in tracked.data.metrics, key
    artifacts = {a.path for a in client.list_artifacts(record["run_id"])}
    assert {"config.json", "deepspeed_config.json"} <= artifacts

    export(run.run_dir)  # the final export's config joins the run's artifacts
    assert {a.path for a in client.list_artifacts(record["run_id"], "export")} == {"export/config.json"}
    assert client.get_run(record["run_id"]).info.status == "FINISHED"
