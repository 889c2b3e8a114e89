"""Training end to end: real DeepSpeed engines on CPU (gloo), world sizes 1 and 2, ZeRO 1-3,
exact resume after SIGKILL and SIGTERM, export, divergence guard, config refusal."""

from __future__ import annotations

import json
import logging
import math
import shutil
import signal

import pytest
import torch

from data_prep.shards.loader import StreamingLoader
from orchestration.exit_codes import PREEMPTED
from pipeline.interchange.export import export, load_export
from pipeline.run_dir.checkpoint import verify_checkpoint
from pipeline.run_dir.rank_files import rank_file
from pipeline.run_dir.reshard import UNIVERSAL_DIR, universal_checkpoint
from pipeline.tracking.tracker import RUN_DIR_TAG
from tests.support.batch_log import logged_global_batches, sequence_digest
from tests.support.train_helpers import MICRO_CONFIG, run_train, run_until_stall, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shards(tinyshakespeare_shards):
    return tinyshakespeare_shards


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory, shards):
    """Uninterrupted 6-step runs, keyed by (world size, ZeRO stage)."""
    root = tmp_path_factory.mktemp("ref")
    runs = {}
    for world, stage in [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]:
        config = write_config(root / f"w{world}z{stage}.yaml", {"train": {"zero_stage": stage}})
        runs[world, stage] = run_train(root / f"w{world}z{stage}", shards, config, world_size=world)
    return runs


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


def test_two_ranks_share_one_mlflow_run_and_one_metrics_log(reference_runs):
    run = reference_runs[2, 2]
    steps = [m["step"] for m in run.metrics() if "train/loss" in m]
    assert steps == [1, 2, 3, 4, 5, 6]  # rank 0 alone logs
    recorded = json.loads((run.run_dir / "mlflow_run.json").read_text())
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=recorded["tracking_uri"])
    of_this_run_dir = f"tags.`{RUN_DIR_TAG}` = '{run.run_dir.resolve()}'"
    assert len(client.search_runs([recorded["experiment_id"]], of_this_run_dir)) == 1
    history = client.get_metric_history(recorded["run_id"], "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]
    params = client.get_run(recorded["run_id"]).data.params
    assert params["train.zero_stage"] == "2" and params["resolved.world_size"] == "2"
    assert (params["train.attention"], params["resolved.attention"], params["resolved.compile"]) == \
        ("auto", "flash", "false")


@pytest.mark.parametrize("stage", [1, 3])
def test_sigkill_then_resume_gives_exactly_the_uninterrupted_losses(tmp_path, shards, reference_runs, stage):
    config = write_config(tmp_path / "c.yaml", {"train": {"zero_stage": stage}})
    run_dir = tmp_path / "run"
    # Checkpoint at step 3; killed during step 5's aftermath: steps 4 and 5 are lost and redone.
    killed = run_until_stall(run_dir, shards, config, stall_after=5, world_size=2, stop=signal.SIGKILL)
    assert killed.returncode != 0
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000003"
    resumed = run_train(run_dir, shards, config, world_size=2)
    assert "resumed from" in resumed.output
    reference = reference_runs[2, stage]
    assert resumed.losses() == reference.losses()  # equal floats, not close
    assert resumed.validations() == reference.validations()
    ours, theirs = load_export_of(run_dir), load_export_of(reference.run_dir)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def load_export_of(run_dir):
    return load_export(export(run_dir, out_dir=run_dir / "export-test")).network.state_dict()


# ----------------------------------------------------------------------------- another number of ranks
FIRST_CHECKPOINT = "step-00000003"  # of the 6-step runs (checkpoint.every = 3)


def stopped_after_first_checkpoint(finished, run_dir):
    """A copy of a finished 6-step run as a job preempted after its checkpoint at step 3
    left it (with an MLflow run of its own)."""
    shutil.copytree(finished, run_dir)
    (run_dir / "checkpoints" / "latest").write_text(FIRST_CHECKPOINT)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")
    (run_dir / "mlflow_run.json").unlink()


def stream_global_batches(shards, steps):
    """Step -> digests of its global batch as the stream defines it, whatever the ranks:
    the sequences [(step - 1) G, step G) of epoch 0."""
    global_batch = MICRO_CONFIG["train"]["global_batch_size"]
    loader = StreamingLoader(shards, "train", global_batch, seed=0)  # train.seed's default
    return {step: [sequence_digest(row) for row in batch] for step, batch in zip(range(1, steps + 1), loader)}


def relative_gap(ours: dict, theirs: dict) -> float:
    flat = lambda state: torch.cat([state[name].flatten() for name in sorted(theirs)])
    return float((flat(ours) - flat(theirs)).norm() / flat(theirs).norm())


@pytest.mark.parametrize("before,after,stage,weight_decay", [(2, 1, 1, None), (1, 2, 3, 0.1)])
def test_resume_on_another_number_of_ranks_sees_the_same_global_batches(tmp_path, shards, reference_runs, before,
                                                                        after, stage, weight_decay):
    """A 6-step run on BEFORE ranks, preempted after its checkpoint at step 3, resumed on AFTER
    ranks: steps 4-6 take the same sequences into the same places of the global batch, and
    give the uninterrupted run's losses and EMA up to float rounding. Step 4 starts from the
    same weights with the same batch, times and masks: equal up to the order of the float64
    sums over ranks. Later the gradients are summed in another order (one rank accumulates
    what two all-reduce), which moves the weights by float32 rounding: the losses stayed within
    1e-8 of the uninterrupted ones (relative), and a lost piece of optimizer state moves them
    by 1e-6 or more (DeepSpeed's ZeRO-3 universal loader, left alone, gives the norms the
    matrices' weight decay: 3e-6 at step 5; and runs their bias correction ahead: 2e-6 at
    step 5, 5e-4 at step 6)."""
    overrides = {"train": {"zero_stage": stage}}
    if weight_decay is None:
        reference = reference_runs[before, stage]
    else:  # weight decay on the matrices only: param groups with their own hyperparameters
        overrides["optim"] = {**MICRO_CONFIG["optim"], "weight_decay": weight_decay}
        reference = run_train(tmp_path / "reference", shards, write_config(tmp_path / "r.yaml", overrides),
                              world_size=before, log_batches=True)
    config = write_config(tmp_path / "c.yaml", overrides)
    run_dir = tmp_path / "run"
    stopped_after_first_checkpoint(reference.run_dir, run_dir)
    resumed = run_train(run_dir, shards, config, world_size=after, log_batches=True)
    assert f"{FIRST_CHECKPOINT} was written by {before} rank(s); resuming it on {after}" in resumed.output
    logged, stream = logged_global_batches(run_dir), stream_global_batches(shards, 6)
    assert {4, 5, 6} <= logged.keys() and logged == {step: stream[step] for step in logged}
    ours, theirs = resumed.losses(), reference.losses()
    assert ours.keys() == theirs.keys() == {1, 2, 3, 4, 5, 6}
    assert ours[4] == pytest.approx(theirs[4], rel=1e-12)
    for step in (5, 6):
        assert ours[step] == pytest.approx(theirs[step], rel=1e-7), step
    assert relative_gap(load_export_of(run_dir), load_export_of(reference.run_dir)) < 1e-7


def test_resume_on_another_micro_batch_size_sees_the_same_global_batches(tmp_path, shards, reference_runs):
    """The 6-step run at micro-batch 2 (4 accumulated), preempted after step 3 and resumed at
    micro-batch 4 (2 accumulated; train.micro_batch_size may change on resume): steps 4-6 take
    the same sequences into the same places with the same times and masks, and give the
    uninterrupted losses up to the order of float sums (a micro-batch of 4 sums its 4 sequences'
    float64 terms where two of 2 did; the gradients accumulate in another order)."""
    reference = reference_runs[1, 1]
    config = write_config(tmp_path / "c.yaml", {"train": {**MICRO_CONFIG["train"], "zero_stage": 1,
                                                          "micro_batch_size": 4}})
    run_dir = tmp_path / "run"
    stopped_after_first_checkpoint(reference.run_dir, run_dir)
    resumed = run_train(run_dir, shards, config, log_batches=True)
    assert "setup: 1 rank(s), micro-batch 4 x 2 accumulation" in resumed.output
    assert "compile off (auto), attention flash (auto)" in resumed.output
    logged, stream = logged_global_batches(run_dir), stream_global_batches(shards, 6)
    assert logged.keys() == {4, 5, 6} and logged == {step: stream[step] for step in logged}
    ours, theirs = resumed.losses(), reference.losses()
    assert ours.keys() == theirs.keys() == {1, 2, 3, 4, 5, 6}
    for step in (4, 5, 6):
        assert ours[step] == pytest.approx(theirs[step], rel=1e-7), step
    assert relative_gap(load_export_of(run_dir), load_export_of(reference.run_dir)) < 1e-6


def test_a_run_from_before_vocab_multiple_is_refused_and_exports_hold_the_true_vocabulary(
        tmp_path, shards, reference_runs):
    """A run unpadded (vocab_multiple 1) and one padded (the default 128) export the same true
    vocabulary. A checkpoint of an earlier unmask, whose config and network lack the field, is
    refused in one line that says how to redo it."""
    reference = reference_runs[1, 1]
    old = write_config(tmp_path / "old.yaml", {"model": {**MICRO_CONFIG["model"], "vocab_multiple": 1},
                                               "train": {**MICRO_CONFIG["train"], "zero_stage": 1, "max_steps": 3}})
    run_dir = tmp_path / "run"
    assert "vocabulary 384 padded to 384" in run_train(run_dir, shards, old).output
    for run in (run_dir, reference.run_dir):  # the padded run's export is unpadded too
        exported = load_export(export(run, out_dir=run / "export-test"))
        assert exported.network.embed.weight.shape[0] == 385 and exported.config["network"]["vocab_multiple"] == 1
    assert json.loads((reference.run_dir / "checkpoints" / FIRST_CHECKPOINT / "unmask_state.json").read_text()
                      )["network"]["vocab_multiple"] == 128
    state_file = run_dir / "checkpoints" / FIRST_CHECKPOINT / "unmask_state.json"
    state = json.loads(state_file.read_text())
    del state["config"]["model"]["vocab_multiple"], state["network"]["vocab_multiple"]
    state_file.write_text(json.dumps(state))
    resumed = run_train(run_dir, shards, write_config(tmp_path / "now.yaml", {"train": {"zero_stage": 1}}), check=False)
    errors = [line for line in resumed.output.splitlines() if "error" in line.lower()]
    assert resumed.returncode == 2 and "Traceback" not in resumed.output, resumed.output[-3000:]
    refusal = (f"unmask train: error: {state_file}: written by an earlier unmask (its config has no "
               f"model.vocab_multiple); train again in a new --run-dir")
    assert errors == [refusal], errors
    assert "resumed from" not in resumed.output


def test_a_conversion_is_reused_by_a_rerun_and_redone_when_broken(tmp_path, reference_runs, caplog):
    """The universal form of a checkpoint (written by rank 0 before a resume on another number
    of ranks) is staged under a temporary name; a rerun reuses it once its files check out."""
    checkpoint = tmp_path / FIRST_CHECKPOINT
    shutil.copytree(reference_runs[2, 1].run_dir / "checkpoints" / FIRST_CHECKPOINT, checkpoint)
    rank_files = [rank_file(checkpoint, rank) for rank in range(2)]
    (checkpoint / (UNIVERSAL_DIR + ".tmp")).mkdir()  # what a killed conversion leaves
    caplog.set_level(logging.INFO, logger="unmask.checkpoint")
    universal = universal_checkpoint(checkpoint, rank_files)
    assert not (checkpoint / (UNIVERSAL_DIR + ".tmp")).exists() and "converted" in caplog.text
    written = {path: path.stat().st_mtime_ns for path in universal.rglob("*")}
    caplog.clear()
    assert universal_checkpoint(checkpoint, rank_files) == universal and "reusing" in caplog.text
    assert {path: path.stat().st_mtime_ns for path in universal.rglob("*")} == written
    altered = universal / "ema.pt"
    altered.write_bytes(altered.read_bytes()[:-8])
    caplog.clear()
    universal_checkpoint(checkpoint, rank_files)
    assert f"converting again ({altered} differs from the one converted)" in caplog.text
    assert verify_checkpoint(checkpoint) is None  # the checkpoint's own files are untouched


def test_sigterm_writes_a_checkpoint_and_resume_continues_exactly(tmp_path, shards, reference_runs):
    config = write_config(tmp_path / "c.yaml", {"train": {"zero_stage": 1}})
    run_dir = tmp_path / "run"
    stopped = run_until_stall(run_dir, shards, config, stall_after=4, stop=signal.SIGTERM)
    # Not finished, not failed: EX_TEMPFAIL, so that a scheduler runs it again (issue 26, item 4).
    assert stopped.returncode == PREEMPTED == 75, stopped.output[-3000:]
    summary = json.loads(next(line for line in stopped.output.splitlines() if line.startswith('{"run_dir"')))
    assert summary["preempted"] is True and summary["step"] == 4
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000004"
    assert not list((run_dir / "checkpoints").glob("*.py")), "DeepSpeed's unpickling recovery scripts"
    resumed = run_train(run_dir, shards, config)
    assert resumed.losses() == reference_runs[1, 1].losses()


def test_export_gathers_zero3_partitions_into_the_model_weights(tmp_path, shards):
    """With EMA decay 0 the EMA is the live weights: our export of the ZeRO-3 partitions must
    equal DeepSpeed's own consolidation of the same checkpoint, and give the same logits."""

    config = write_config(tmp_path / "c.yaml", {"train": {"zero_stage": 3, "ema_decay": 0.0, "max_steps": 3}})
    run_dir = tmp_path / "run"
    run_train(run_dir, shards, config, world_size=2)
    ema = load_export(export(run_dir, out_dir=tmp_path / "ema"))
    model = load_export(export(run_dir, weights="model", out_dir=tmp_path / "model"))
    ema_weights, model_weights = ema.network.state_dict(), model.network.state_dict()
    assert ema_weights.keys() == model_weights.keys()
    for name in ema_weights:
        assert torch.equal(ema_weights[name], model_weights[name]), name
    z = torch.randint(0, ema.network.config.vocab_size + 1, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ema.network(z), model.network(z))
    assert ema.config["step"] == 3 and ema.tokenizer.sha256 == ema.config["tokenizer_sha256"]


def test_ema_export_differs_from_the_live_weights(reference_runs, tmp_path):
    run_dir = reference_runs[2, 3].run_dir
    ema = load_export(export(run_dir, out_dir=tmp_path / "ema")).network.state_dict()
    live = load_export(export(run_dir, weights="model", out_dir=tmp_path / "model")).network.state_dict()
    gap = max((ema[k] - live[k]).abs().max().item() for k in ema)
    assert gap > 1e-4  # decay 0.9 over 6 steps lags the weights


def test_resume_refuses_a_changed_config_and_names_the_field(tmp_path, shards, reference_runs):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(reference_runs[1, 1].run_dir, run_dir)
    config = write_config(tmp_path / "c.yaml", {"train": {"zero_stage": 1, "max_steps": 8}})
    refused = run_train(run_dir, shards, config, extra=["--optim.lr", "5e-4"], check=False)
    assert refused.returncode == 2
    assert "optim.lr: checkpoint 0.001, now 0.0005" in refused.output
    allowed = run_train(run_dir, shards, config, extra=["--optim.lr", "5e-4", "--allow-config-change"])
    assert max(allowed.losses()) == 8  # max_steps may change freely
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert kept == ["step-00000006", "step-00000008"]  # keep_last = 2 (step 3 was pruned)
    record = json.loads((run_dir / "mlflow_run.json").read_text())
    from mlflow.tracking import MlflowClient

    tracked = MlflowClient(record["tracking_uri"]).get_run(record["run_id"]).data
    assert tracked.params["optim.lr"] == "0.001"  # params keep the values the run started with
    assert "optim.lr: checkpoint 0.001, now 0.0005" in tracked.tags["config_change.step_6"]


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


def test_resume_refuses_different_data(tmp_path, shards, reference_runs):
    import shutil

    run_dir, other = tmp_path / "run", tmp_path / "other-shards"
    shutil.copytree(reference_runs[1, 1].run_dir, run_dir)
    shutil.copytree(shards, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["counts"]["note"] = 1  # any change to the manifest is different data
    (other / "manifest.json").write_text(json.dumps(manifest))
    config = write_config(tmp_path / "c.yaml", {"train": {"zero_stage": 1, "max_steps": 8}})
    refused = run_train(run_dir, other, config, check=False)
    assert refused.returncode == 2
    assert "its data (manifest.json) differs" in refused.output


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
