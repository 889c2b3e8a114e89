"""Resuming a run (``pipeline.run_dir.resume``): after a crash it gives exactly the uninterrupted
run's losses, also at another micro-batch size; a changed config, other data, a network of
another shape and a checkpoint of an earlier unmask are refused in one line that names the field,
the tensor or the fix. Resuming on another number of ranks: ``test_reshard.py``; after SIGTERM:
``tests/pipeline/training/test_signals.py``."""

from __future__ import annotations

import json
import re
import shutil
import signal

import pytest
import torch

from common.errors import UserError
from model.spec import ModelSpec
from model.transformer import preset
from pipeline.config import Config, config_differences, load_config
from pipeline.interchange.export import export, load_export
from pipeline.run_dir.checkpoint import EarlierCheckpoint
from pipeline.run_dir.resume import check_resumable
from tests.support.batch_log import logged_global_batches
from tests.support.reference_runs import (
    FIRST_CHECKPOINT,
    load_export_of,
    relative_gap,
    stopped_after_first_checkpoint,
    stream_global_batches,
)
from tests.support.train_helpers import (
    MICRO_CONFIG,
    MICRO_RUN,
    checkpoint_meta,
    run_train,
    run_until_stall,
    write_config,
)

VOCAB = 37


@pytest.fixture
def run(micro_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(micro_run, copy)
    return copy


# ------------------------------------------------------------------ exactly where it stopped
@pytest.mark.slow
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


@pytest.mark.slow
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


# ------------------------------------------------------------------ what a resume refuses
@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_config_change_that_reshapes_the_network_is_one_line_naming_the_tensor(run, tinyshakespeare_shards, tmp_path):
    config = write_config(tmp_path / "micro.yaml", MICRO_RUN)
    resumed = run_train(run, tinyshakespeare_shards, config, check=False,
                        extra=["--allow-config-change", "--model.d_model", "96", "--train.max_steps", "3"])
    assert resumed.returncode == 2 and "Traceback" not in resumed.output
    errors = [line for line in resumed.output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, resumed.output[-3000:]
    assert re.fullmatch(r"unmask train: error: cannot resume .*step-00000002: the network changed shape "
                        r"\(model.d_model\): \S+ is \[[\d, ]*64[\d, ]*\] in the checkpoint and \[[\d, ]*96[\d, ]*\] in "
                        r"this config. --allow-config-change cannot reshape weights: keep the checkpoint's model "
                        r"section, or train this one in a new --run-dir", errors[0]), errors[0]


# ------------------------------------------------------------------ checkpoints of an earlier unmask
def test_vocab_multiple_is_validated_and_a_checkpoint_without_it_is_refused(tmp_path):
    assert Config().model.vocab_multiple == 128
    with pytest.raises(UserError, match="config field model.vocab_multiple = 0: must be >= 1"):
        load_config(None, {"model.vocab_multiple": "0"})
    saved = Config().to_dict()
    del saved["model"]["vocab_multiple"]  # a checkpoint of an earlier unmask, written before the field
    now = Config().to_dict()
    assert config_differences(saved, now) == ["model.vocab_multiple: checkpoint None, now 128"]
    directory = tmp_path / "checkpoints" / "step-00000003"
    for allow in (False, True):  # not a config change: a format this unmask does not read
        with pytest.raises(EarlierCheckpoint, match=r"step-00000003/unmask_state.json: written by an earlier unmask "
                                                    r"\(its config has no model.vocab_multiple\); train again in a "
                                                    r"new --run-dir"):
            check_resumable(checkpoint_meta(saved), checkpoint_meta(now), directory, data_dir=tmp_path,
                            allow_config_change=allow)
    assert check_resumable(checkpoint_meta(now), checkpoint_meta(now), directory, data_dir=tmp_path,
                           allow_config_change=False) == []
    # Exports of those runs have no such key either: refused, naming it (export again).
    record = ModelSpec(network=preset("tiny", VOCAB)).to_dict()
    del record["network"]["vocab_multiple"]
    with pytest.raises(ValueError, match="no key 'network.vocab_multiple'"):
        ModelSpec.from_dict(record)


def test_a_checkpoint_without_the_compile_fields_is_refused_and_the_loss_chunking_is_not_resume_safe(tmp_path):
    saved = Config().to_dict()
    for field in ("compile", "chunked_cross_entropy"):
        del saved["train"][field]
    with pytest.raises(EarlierCheckpoint, match=r"written by an earlier unmask \(its config has no train.compile\)"):
        check_resumable(checkpoint_meta(saved), checkpoint_meta(Config().to_dict()), tmp_path, data_dir=tmp_path,
                        allow_config_change=True)
    assert config_differences(Config().to_dict(), load_config(None, {"train.chunked_cross_entropy": "8"}).to_dict()) \
        == ["train.chunked_cross_entropy: checkpoint 0, now 8"]


@pytest.mark.slow
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
