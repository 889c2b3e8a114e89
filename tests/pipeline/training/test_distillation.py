"""Self-distillation through time (``unmask distill``, pipeline.training.distillation): the loss and
its targets against direct formulas, the refusals, and real distillation runs of a tiny teacher
(the divergence falls round by round, a run stopped mid-round resumes bit for bit)."""

from __future__ import annotations

import json
import math
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_model
from torch import nn

from common.errors import UserError
from model.absorbing import AbsorbingDiffusion
from model.schedules import make_schedule
from model.spec import build_network
from orchestration.exit_codes import PREEMPTED
from pipeline.config import ModelSection, distillation_config, load_config
from pipeline.interchange.export import load_export
from pipeline.training.distillation import (
    DIVERGENCES,
    distillation_loss,
    divergence,
    student_times,
    teacher_file,
    teacher_targets,
)
from tests.support.cli_runner import run_unmask
from tests.support.denoisers import TableDenoiser
from tests.support.export_fixtures import write_untrained_export
from tests.support.train_helpers import Run, run_train, run_until_stall, write_config

VOCAB, LENGTH = 3, 4


def _process() -> AbsorbingDiffusion:
    return AbsorbingDiffusion(make_schedule("linear"), VOCAB)


def _generators(seed: int, rows: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 100 + row) for row in range(rows)]


def _batch(rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x0 = torch.randint(0, VOCAB, (rows, LENGTH), generator=generator)
    return x0, torch.rand(rows, generator=generator, dtype=torch.float64).clamp(min=0.05)


# ------------------------------------------------------------------ the loss and its targets
@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_the_loss_is_zero_when_the_student_is_the_teacher_and_its_two_steps_reveal_nothing(name):
    teacher = TableDenoiser(VOCAB, LENGTH, seed=1, time_weight=1.0)
    x0, t = _batch()
    still = distillation_loss(teacher, teacher, _process(), x0, t, 0.0, _generators(0, len(t)), name)
    assert torch.equal(still, torch.zeros_like(still))
    # Steps that reveal tokens give targets that differ from the student's own prediction.
    moving = distillation_loss(teacher, teacher, _process(), x0, t, 0.25, _generators(0, len(t)), name)
    assert moving.sum() > 0


def test_each_target_is_the_teachers_logits_at_the_call_that_revealed_it():
    teacher, process = TableDenoiser(VOCAB, LENGTH, seed=2, time_weight=1.0), _process()
    x0, t = _batch()
    step = 0.2
    z_t, masked = process._corrupt(x0, t, _generators(3, len(t)))
    targets = teacher_targets(teacher, process, z_t, masked, t, step, _generators(4, len(t)))
    (first_z, first_t), (z_s, s) = teacher.calls
    assert torch.equal(first_z, z_t) and torch.equal(first_t, t)
    torch.testing.assert_close(s, (t - step).clamp(min=0.0), rtol=0, atol=0)
    assert torch.equal(z_s[~masked], z_t[~masked]) and bool((z_s[masked] == process.mask_id).any())
    revealed = masked & (z_s != process.mask_id)
    assert bool(revealed.any())
    first = TableDenoiser(VOCAB, LENGTH, seed=2, time_weight=1.0).logits(z_t, t)
    second = TableDenoiser(VOCAB, LENGTH, seed=2, time_weight=1.0).logits(z_s, s)
    expected = torch.where(revealed[..., None], first, second)[masked]
    torch.testing.assert_close(targets, expected.float())


def test_every_divergence_matches_its_formula():
    generator = torch.Generator().manual_seed(0)
    student, target = torch.randn(5, 7, generator=generator), torch.randn(5, 7, generator=generator)
    p, q = student.double().softmax(-1), target.double().softmax(-1)
    formulas = {"reverse_kl": (p * (p / q).log()).sum(-1), "forward_kl": (q * (q / p).log()).sum(-1),
                "mse": (p.log() - q.log()).square().mean(-1), "tvd": 0.5 * (p - q).abs().sum(-1)}
    assert set(formulas) == set(DIVERGENCES)
    for name, expected in formulas.items():
        torch.testing.assert_close(divergence(name, student, target).double(), expected, rtol=1e-5, atol=1e-6)


def test_student_times_lie_on_the_students_grid():
    u = torch.tensor([0.0, 0.1249, 0.125, 0.5, 0.9999], dtype=torch.float64)
    assert student_times(u, 8).tolist() == [1 / 8, 1 / 8, 2 / 8, 5 / 8, 1.0]


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(("overrides", "field"), [
    ({"model.process": "uniform", "model.time_conditioning": "true"}, "model.process"),
    ({"model.process": "learned", "model.time_conditioning": "true"}, "model.process"),
    ({"model.block_size": "8"}, "model.block_size"),
    ({"model.objective": "autoregressive"}, "model.objective"),
    ({"distill.end_steps": "3"}, "distill.end_steps"),
    ({"distill.end_steps": "1024"}, "distill.end_steps"),
    ({"distill.round_steps": "0"}, "distill.round_steps"),
])
def test_a_refused_process_or_bad_option_gets_one_line_naming_the_field(overrides, field):
    with pytest.raises(UserError, match=rf"^config field {field} ") as refused:
        distillation_config(load_config(None, overrides), max_steps_given=False)
    assert "\n" not in str(refused.value)


def test_unmask_distill_sets_the_rounds_steps_and_holds_a_given_max_steps_to_them():
    config = distillation_config(load_config(None, {"distill.round_steps": "10"}), max_steps_given=False)
    assert config.distill.enabled and config.distill.rounds == 7 and config.train.max_steps == 70
    with pytest.raises(UserError, match=r"^config field train.max_steps = 50: a distillation is 7 rounds .* set 70"):
        distillation_config(load_config(None, {"distill.round_steps": "10", "train.max_steps": "50"}),
                            max_steps_given=True)


# ------------------------------------------------------------------ real runs of a tiny teacher
DISTILL = {"distill": {"start_steps": 4, "end_steps": 1, "round_steps": 6},
           "train": {"ema_decay": 0.0}, "optim": {"lr": 5e-4, "warmup_steps": 0},
           "eval": {"every": 6, "batches": 1}, "checkpoint": {"every": 3, "keep_last": 4}}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tinyshakespeare_shards) -> Path:
    """An untrained export of MICRO_CONFIG's network over the shards' tokenizer, its weights drawn
    wide (std 0.3): sharp predictions that depend on the context, so that its two steps differ
    from one (about 0.5 nats per token at 2 and 1 steps), as a trained model's do. A tiny model
    trained for the seconds a test affords predicts the unigram, which leaves nothing to distil."""
    from data_prep.tokenizer.load import load_tokenizer

    tokenizer_dir = tinyshakespeare_shards / "tokenizer"
    torch.manual_seed(0)
    return write_untrained_export(tmp_path_factory.mktemp("teacher") / "export", load_tokenizer(tokenizer_dir),
                                  tokenizer_dir, n_layers=2, d_model=64, n_heads=2, max_seq_len=64, init_std=0.3)


@pytest.fixture(scope="module")
def student(tmp_path_factory, tinyshakespeare_shards, teacher) -> Run:
    """Two rounds (teacher 4 -> 2 steps, student 2 -> 1) of 6 steps, exported; EMA decay 0: the
    export and each round's next teacher are the live weights."""
    root = tmp_path_factory.mktemp("student")
    config = write_config(root / "distill.yaml", DISTILL)
    run = run_train(root / "run", tinyshakespeare_shards, config, command=("distill", str(teacher)))
    exported = run_unmask(["export", str(run.run_dir)])
    assert exported.returncode == 0, exported.stderr[-3000:]
    return run


def _held_out_divergence(student: nn.Module, teacher: nn.Module, process: AbsorbingDiffusion, x0: torch.Tensor,
                         student_steps: int) -> float:
    """The distillation loss per token on fixed sequences, times (spread over the student's grid) and draws."""
    t = student_times(torch.arange(x0.shape[0], dtype=torch.float64) / x0.shape[0], student_steps)
    with torch.no_grad():
        loss = distillation_loss(student, teacher, process, x0, t, 1 / (2 * student_steps), _generators(9, len(t)),
                                 "reverse_kl")
    return float(loss.sum()) / x0.numel()


def test_each_rounds_student_is_closer_to_its_teacher_than_the_rounds_start(student, tinyshakespeare_shards):
    """Round k's teacher is its start (the student begins as it); its end is the next round's
    teacher, and the export for the last round. Measured at the round's student steps."""
    from data_prep.shards.loader import StreamingLoader

    x0 = next(iter(StreamingLoader(tinyshakespeare_shards, "val", 32, shuffle=False)))
    exported = load_export(student.run_dir / "export")
    process = exported.process()

    def teacher_of(round_: int) -> nn.Module:  # as trained: rows padded to model.vocab_multiple (the export drops them)
        padded = replace(exported.spec, network=replace(exported.spec.network, vocab_multiple=ModelSection.vocab_multiple))
        network = build_network(padded).eval()
        load_model(network, str(teacher_file(student.run_dir, round_)))
        return network

    ends = [teacher_of(1), exported.network]
    for round_, student_steps in ((0, 2), (1, 1)):  # round k: the teacher's 4 / 2^k steps, the student's half
        teacher = teacher_of(round_)
        start = _held_out_divergence(teacher, teacher, process, x0, student_steps)
        end = _held_out_divergence(ends[round_], teacher, process, x0, student_steps)
        assert end < 0.9 * start, (round_, start, end)
    metrics = [m for m in student.metrics() if "distill/round" in m]
    assert [(m["step"], m["distill/round"], m["distill/student_steps"]) for m in metrics][::3] == [
        (1, 0, 2), (4, 0, 2), (7, 1, 1), (10, 1, 1)]


def test_the_student_export_records_its_distillation(student, teacher):
    config = load_export(student.run_dir / "export").config
    assert config["distilled"] == {"steps": 1, "round": 2, "rounds": 2, "round_complete": True, "start_steps": 4,
                                   "divergence": "reverse_kl", "refresh_teacher": True}
    assert config["init_from"]["source"] == str(teacher)


def test_a_run_stopped_mid_round_resumes_to_the_same_losses_bit_for_bit(student, teacher, tinyshakespeare_shards,
                                                                         tmp_path):
    config = write_config(tmp_path / "distill.yaml", DISTILL)
    stopped = run_until_stall(tmp_path / "run", tinyshakespeare_shards, config, stall_after=8, stop=signal.SIGTERM,
                              command=("distill", str(teacher)))
    assert stopped.returncode == PREEMPTED, stopped.output[-3000:]
    assert set(stopped.losses()) == set(range(1, 9))  # stopped in round 1 (steps 7 to 12), its teacher on disk
    resumed = run_train(tmp_path / "run", tinyshakespeare_shards, config, command=("distill", str(teacher)))
    assert resumed.losses() == student.losses()  # floats compared exactly


def test_the_student_samples_and_evaluates_through_the_command_line(student, tinyshakespeare_shards, tmp_path):
    sampled = run_unmask(["sample", str(student.run_dir), "--num", "2", "--steps", "1", "--seq-len", "32"])
    assert sampled.returncode == 0 and sampled.stdout.count("(network calls: 1)") == 2, sampled.stderr[-3000:]
    evaluated = run_unmask(["eval", str(student.run_dir), "--datasets", "val", "--shards", str(tinyshakespeare_shards),
                            "--out", str(tmp_path / "report"), "--max-documents", "8", "--samples", "2",
                            "--batch-size", "8"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    assert math.isfinite(results["datasets"]["val"]["perplexity_bound"])
