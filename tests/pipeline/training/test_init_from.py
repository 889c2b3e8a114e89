"""``unmask train --init-from``: a new run starts from another run's weights (``pipeline.training.init_from``).

Real DeepSpeed engines on CPU (world size 1, every ZeRO stage), trained in this process through
``pipeline.training.trainer.train``. The source is the session's ``micro_run`` (a 2-step run), as a run
directory or as an export whose weights are moved far from any initialization, so that a
loss at the source's weights cannot be met by chance.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.errors import UserError
from pipeline.config import load_config
from pipeline.interchange.export import (
    CONFIG_FILE,
    TOKENIZER_DIR,
    WEIGHTS_FILE,
    checkpoint_tensors,
    export,
    load_export,
    write_export,
)
from pipeline.run_dir.checkpoint import STATE_FILE, read_state, resolve_checkpoint
from pipeline.training.ema import ema_decay
from pipeline.training.hooks import TrainHooks
from pipeline.training.init_from import InitFrom, read_source, recorded_source
from pipeline.training.objective import MicroBatchSlot, make_objective
from pipeline.training.trainer import train
from tests.support.cli_runner import DISTRIBUTED_ENV, unmask_in_process
from tests.support.train_helpers import MICRO_CONFIG, write_config

# The new run: one micro-batch per step, another seed (its own initialization differs from the
# source's), another schedule and learning rate than the source's.
NEW_RUN = {"train": {"max_steps": 1, "global_batch_size": 2, "micro_batch_size": 2, "seed": 7},
           "model": {"schedule": "cosine"}, "optim": {"lr": 3.0e-3},
           "eval": {"every": 0, "batches": 1}, "logging": {"mlflow": False}}
# Spread of the noise added to the exported weights (the init's std is 0.02).
PERTURBATION = 0.05


def _config(tmp_path: Path, **sections: dict):
    layers = {name: {**NEW_RUN.get(name, {}), **sections.get(name, {})} for name in {*NEW_RUN, *sections}}
    return load_config(write_config(tmp_path / "new.yaml", layers))


@pytest.fixture(scope="module")
def source_export(micro_run, tmp_path_factory) -> Path:
    """An export of ``micro_run`` whose weights are perturbed: trained-looking, nowhere near an init."""
    root = tmp_path_factory.mktemp("source")
    trained = export(micro_run, out_dir=root / "trained")
    tensors = load_file(str(trained / WEIGHTS_FILE))
    noise = torch.Generator().manual_seed(3)
    moved = {name: t + PERTURBATION * torch.randn(t.shape, generator=noise) for name, t in tensors.items()}
    # Written as an export is (its marker records the files), not patched in place: that is damage.
    config = json.loads((trained / CONFIG_FILE).read_text())
    write_export(root / "export", moved, config, trained / TOKENIZER_DIR)
    return root / "export"


def _train(config, data: Path, run_dir: Path, init_from: InitFrom | None) -> tuple[object, dict[int, torch.Tensor]]:
    """Train in this process; the result and each step's (single) micro-batch."""
    batches: dict[int, torch.Tensor] = {}
    hooks = TrainHooks(on_batch=lambda step, first, x0: batches.setdefault(step, x0.clone()))
    with _launcher_variables_kept():
        return train(config, data_dir=data, run_dir=run_dir, init_from=init_from, hooks=hooks), batches


@contextlib.contextmanager
def _launcher_variables_kept():
    """The block leaves RANK, MASTER_PORT, ... as it found them, whether it raises or not: a
    training in this process must not hand its rendezvous to what the process starts later."""
    before = {name: os.environ.get(name) for name in DISTRIBUTED_ENV}
    try:
        yield
    finally:
        assert {name: os.environ.get(name) for name in DISTRIBUTED_ENV} == before


def _loss_at(tensors: dict[str, torch.Tensor], export_dir: Path, config, x0: torch.Tensor, step: int) -> float:
    """The new run's training loss at ``step`` (0-based) on ``x0`` with the network of
    ``export_dir``'s shape holding ``tensors``, computed outside the trainer."""
    network = load_export(export_dir).network
    network.load_state_dict(tensors)
    objective = make_objective(config.model.spec(network.config), validate=True)
    slot = MicroBatchSlot(seed=config.train.seed, step=step, rank=0, world_size=1, micro=0, micro_batches=1)
    with torch.no_grad():
        return float(objective.loss_sum(network, x0, slot)) / x0.numel()


def _step_losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("zero_stage, source, weights", [(1, "export", None), (2, "run", "model"), (3, "run", None)])
def test_the_first_loss_is_the_sources_and_the_ema_starts_from_its_weights(
        zero_stage, source, weights, source_export, micro_run, tinyshakespeare_shards, tmp_path):
    config = _config(tmp_path, train={"zero_stage": zero_stage})
    path = source_export if source == "export" else micro_run
    result, batches = _train(config, tinyshakespeare_shards, tmp_path / "new", InitFrom(path, weights))

    if source == "export":
        expected, shape_of = load_file(str(source_export / WEIGHTS_FILE)), source_export
    else:  # the run's own export of the same weights: what --init-from must have loaded
        shape_of = export(micro_run, weights=weights or "ema", out_dir=tmp_path / "source-export")
        expected = load_file(str(shape_of / WEIGHTS_FILE))
    assert _step_losses(tmp_path / "new")[1] == pytest.approx(_loss_at(expected, shape_of, config, batches[1], 0),
                                                              rel=1e-6)
    # One EMA update from the loaded weights (not from the run's own initialization).
    checkpoint = resolve_checkpoint(tmp_path / "new")
    (ema, _), (live, _) = checkpoint_tensors(checkpoint, "ema"), checkpoint_tensors(checkpoint, "model")
    decay = ema_decay(config.train.ema_decay, 0, config.train.ema_warmup)
    for name, tensor in ema.items():
        torch.testing.assert_close(tensor, decay * expected[name] + (1 - decay) * live[name], rtol=0, atol=1e-6)

    record = read_state(checkpoint).init_from
    sources = {"export": (source_export, WEIGHTS_FILE), "run": (micro_run, f"checkpoints/step-00000002/{STATE_FILE}")}
    root, hashed = sources[source]
    assert record["source"] == str(root.resolve()) and record["file"] == hashed
    assert record["sha256"] == _sha256(root / hashed) and record["step"] == 2
    assert record["weights"] == (weights or "ema") and record["kind"] == source
    assert record["config_sha256"] == read_state(resolve_checkpoint(micro_run)).config_sha256
    assert result.summary()["init_from"] == record


def test_provenance_reaches_mlflow_and_the_export_and_a_resume_does_not_reload(
        source_export, micro_run, tinyshakespeare_shards, tmp_path):
    from mlflow.tracking import MlflowClient

    # A copy of the source, deleted before the resume: resuming needs only the run's own checkpoint.
    copy = shutil.copytree(source_export, tmp_path / "source")
    run_dir, source = tmp_path / "new", InitFrom(copy)
    config = _config(tmp_path, logging={"mlflow": True})
    first, _ = _train(config, tinyshakespeare_shards, run_dir, source)
    record = first.summary()["init_from"]
    tracking = json.loads((run_dir / "mlflow_run.json").read_text())
    logged = MlflowClient(tracking["tracking_uri"]).get_run(first.mlflow_run_id).data
    assert logged.params["init_from.source"] == str(copy.resolve())
    assert logged.params["init_from.sha256"] == record["sha256"] == _sha256(source_export / WEIGHTS_FILE)
    assert logged.tags["init_from"] == record["source"] and logged.tags["init_from_sha256"] == record["sha256"]
    exported = export(run_dir, out_dir=tmp_path / "export")
    assert json.loads((exported / CONFIG_FILE).read_text())["init_from"] == record

    # The same command, run longer: it continues from its own step-1 checkpoint.
    live, _ = checkpoint_tensors(resolve_checkpoint(run_dir), "model")
    shutil.rmtree(copy)
    longer = load_config(write_config(tmp_path / "longer.yaml", {**NEW_RUN, "train": {**NEW_RUN["train"],
                                                                                      "max_steps": 2}}))
    resumed_result, batches = _train(longer, tinyshakespeare_shards, run_dir, source)
    assert list(batches) == [2] and resumed_result.summary()["init_from"] == record
    resumed = _step_losses(run_dir)[2]
    assert resumed == pytest.approx(_loss_at(live, exported, longer, batches[2], 1), rel=1e-6)
    source_weights = load_file(str(source_export / WEIGHTS_FILE))
    assert resumed != pytest.approx(_loss_at(source_weights, exported, longer, batches[2], 1), rel=1e-3)

    with pytest.raises(UserError, match=r"was started from export .* and has checkpoints \(latest step 2\)"):
        train(longer, data_dir=tinyshakespeare_shards, run_dir=run_dir, init_from=InitFrom(micro_run))
    with pytest.raises(UserError, match="already has checkpoints of a run started from scratch"):
        recorded_source(micro_run, source)


def test_a_network_of_another_shape_is_refused_naming_the_tensor_and_both_shapes(
        source_export, tinyshakespeare_shards, tmp_path):
    config = _config(tmp_path, model={**MICRO_CONFIG["model"], "d_model": 32})
    with _launcher_variables_kept(), pytest.raises(UserError, match=r"embed\.weight is \[385, 64\] in the source "
                                                                  r"and \[385, 32\] here"):
        train(config, data_dir=tinyshakespeare_shards, run_dir=tmp_path / "new", init_from=InitFrom(source_export))
    time_conditioned = _config(tmp_path, model={"time_conditioning": True})
    with pytest.raises(UserError, match=r"time_embed\.mlp\.0\.weight is absent in the source and \[128, 128\] here"):
        train(time_conditioned, data_dir=tinyshakespeare_shards, run_dir=tmp_path / "new2",
              init_from=InitFrom(source_export))


def test_a_source_of_another_tokenizer_is_refused_with_the_fix(source_export, tinyshakespeare_shards, tmp_path):
    other = shutil.copytree(source_export, tmp_path / "other")
    config_json = json.loads((other / CONFIG_FILE).read_text())
    (other / CONFIG_FILE).write_text(json.dumps({**config_json, "tokenizer_sha256": "0" * 64}))
    with pytest.raises(UserError, match=rf"prepare the data with the source's: `unmask prep --tokenizer {other}"):
        train(_config(tmp_path), data_dir=tinyshakespeare_shards, run_dir=tmp_path / "new", init_from=InitFrom(other))
    assert not (tmp_path / "new" / "checkpoints").exists()


def test_sources_that_are_not_an_export_or_a_trained_run_are_refused(source_export, tmp_path):
    cases = [(tmp_path / "missing", None, "does not exist"),
             (tmp_path, None, "neither an export .*, a training run .* nor a Hugging Face model"),
             (source_export, "model", "an export holds one set of weights")]
    (tmp_path / "untrained" / "checkpoints").mkdir(parents=True)
    cases.append((tmp_path / "untrained", None, "a training run with no checkpoint yet"))
    for path, weights, message in cases:
        with pytest.raises(UserError, match=message):
            read_source(InitFrom(path, weights))


def test_the_flags_of_train_and_run(tmp_path):
    from orchestration.cli import build_parser
    from orchestration.commands.train import init_from_args

    parser = build_parser()
    for command in ("train", "run"):
        args, _ = parser.parse_known_args([command, "--init-from", "runs/a", "--init-weights", "model"])
        assert init_from_args(args) == InitFrom("runs/a", "model")
        args, _ = parser.parse_known_args([command])
        assert init_from_args(args) is None
    args, _ = parser.parse_known_args(["train", "--init-weights", "model"])
    with pytest.raises(UserError, match="pass --init-from too"):
        init_from_args(args)


def test_the_train_stage_of_unmask_run_refuses_another_source(micro_run, source_export, tmp_path):
    from orchestration.stages import RunRequest, StageContext, _stage_train

    run_dir = shutil.copytree(micro_run, tmp_path / "run")
    request = RunRequest(run_dir=run_dir, config=load_config(write_config(tmp_path / "c.yaml")),
                         init_from=InitFrom(source_export))
    with pytest.raises(UserError, match="--init-from starts a new run: choose a new --run-dir"):
        _stage_train(request, StageContext())


def test_an_mdlm_import_trains_with_its_own_network_under_a_new_schedule(tinyshakespeare_shards, tmp_path):
    """MDLM's DiT (biases, an untied head with the mask's row, adaLN from sigma(t)) is no
    network a config describes: the run takes those options from the import, its shape from
    the config, and its first loss is the imported weights' under the new (linear) schedule."""
    from pipeline.interchange.mdlm_import import import_mdlm
    from tests.support.mdlm_reference import DiTShape, random_weights, write_hugging_face

    shape = DiTShape(vocab_size=384, width=64, n_heads=4, length=64)
    hugging_face = write_hugging_face(tmp_path / "mdlm", random_weights(shape, seed=5), shape)
    imported = import_mdlm(hugging_face, tinyshakespeare_shards / "tokenizer", tmp_path / "import")
    config = _config(tmp_path, model={**MICRO_CONFIG["model"], "n_heads": 4, "schedule": "linear"})
    result, batches = _train(config, tinyshakespeare_shards, tmp_path / "new", InitFrom(imported))
    expected = load_file(str(imported / WEIGHTS_FILE))
    assert _step_losses(tmp_path / "new")[1] == pytest.approx(_loss_at(expected, imported, config, batches[1], 0),
                                                              rel=1e-6)
    record = result.summary()["init_from"]
    assert (record["kind"], record["weights"], record["step"], record["config_sha256"]) == \
        ("export", "published", None, None)
    assert read_state(resolve_checkpoint(tmp_path / "new")).network["mlp_bias"] is True
    # Resumed without the flag (the import may be gone): the checkpoint's record shapes the network.
    longer = _config(tmp_path, model={**MICRO_CONFIG["model"], "n_heads": 4, "schedule": "linear"},
                     train={"max_steps": 2})
    assert _train(longer, tinyshakespeare_shards, tmp_path / "new", None)[0].step == 2


def test_a_bd3lm_import_fine_tunes_as_a_block_model_from_its_weights(tmp_path):
    """BD3-LM's released network (adaLN at sigma = 0, biases, the mask's head row; tests/fixtures/bd3lm,
    written by its own code) fine-tunes at its block size: the run takes the import's network
    options, and its first loss is the imported weights' block-diffusion loss."""
    from pipeline.interchange.bd3lm_import import import_bd3lm
    from tests.support.bd3lm_fixtures import EOS, WORDS, source_copy, write_tokenizer

    tokenizer = write_tokenizer(tmp_path / "tokenizer")
    imported = import_bd3lm(source_copy(tmp_path, "released"), tokenizer, tmp_path / "import")
    words = torch.randint(2, len(WORDS), (200, 40), generator=torch.Generator().manual_seed(0)).tolist()
    (tmp_path / "corpus.txt").write_text("\n\n".join(" ".join(WORDS[i] for i in doc) for doc in words))
    assert unmask_in_process(["prep", "--input", str(tmp_path / "corpus.txt"), "--tokenizer", str(tokenizer),
                              "--eos-token", EOS, "--out", str(tmp_path / "shards"), "--seq-len", "16",
                              "--val-fraction", "0.1"]) == 0
    config = _config(tmp_path, model={"preset": "tiny", "n_layers": 2, "d_model": 16, "n_heads": 2, "max_seq_len": 16,
                                      "block_size": 4, "schedule": "loglinear"})
    _, batches = _train(config, tmp_path / "shards", tmp_path / "new", InitFrom(imported))
    expected = load_file(str(imported / WEIGHTS_FILE))
    assert _step_losses(tmp_path / "new")[1] == pytest.approx(_loss_at(expected, imported, config, batches[1], 0),
                                                              rel=1e-6)
    assert read_state(resolve_checkpoint(tmp_path / "new")).network["adaptive_norm"] is True


@pytest.mark.slow
def test_two_ranks_under_zero3_start_from_the_source(source_export, tinyshakespeare_shards, tmp_path):
    """`unmask train --init-from` under torchrun: each rank's ZeRO-3 partition, and its EMA,
    starts from the source (the EMA after one step is the decay's mix of source and live weights)."""
    from tests.support.train_helpers import run_train

    layers = {**NEW_RUN, "train": {**NEW_RUN["train"], "zero_stage": 3, "global_batch_size": 4}}
    run = run_train(tmp_path / "new", tinyshakespeare_shards, write_config(tmp_path / "new.yaml", layers),
                    world_size=2, extra=["--init-from", str(source_export)])
    checkpoint = resolve_checkpoint(run.run_dir)
    assert read_state(checkpoint).world_size == 2
    (ema, _), (live, _) = checkpoint_tensors(checkpoint, "ema"), checkpoint_tensors(checkpoint, "model")
    source = load_file(str(source_export / WEIGHTS_FILE))
    decay = ema_decay(MICRO_CONFIG["train"]["ema_decay"], 0, True)
    for name, tensor in ema.items():
        torch.testing.assert_close(tensor, decay * source[name] + (1 - decay) * live[name], rtol=0, atol=1e-6)
    summary = next(json.loads(line) for line in run.output.splitlines() if line.startswith('{"run_dir"'))
    assert summary["init_from"]["source"] == str(source_export.resolve())
