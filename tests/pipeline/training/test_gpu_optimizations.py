"""The training speed switches (issue 7) change cost, not the loss: logits at masked
positions only, chunked cross-entropy, SDPA's kernels, fused AdamW, torch.compile, the
"auto" activation-checkpointing decision, their config fields, and a CPU smoke run of
bench/train_gpu.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common.errors import UserError
from model.absorbing import AbsorbingDiffusion
from model.cross_entropy import chunked_cross_entropy
from model.schedules import make_schedule
from model.transformer import Transformer, TransformerConfig, parameter_counts, preset
from pipeline.config import Config, config_differences, load_config
from pipeline.run_dir.checkpoint import EarlierCheckpoint
from pipeline.run_dir.resume import check_resumable
from pipeline.training.engine import (
    BLOCK_ACTIVATION_WIDTHS,
    BLOCK_FLOAT32_WIDTHS,
    USABLE_MEMORY_SHARE,
    activation_memory_bytes,
    build_optimizer,
    model_state_bytes,
    plan_batches,
    prepare_model,
    resolve_activation_checkpointing,
)
from tests.support.cli_runner import CLI_TIMEOUT_S, cli_env
from tests.support.paths import GPT2, REPO, TINY, require_shared
from tests.support.train_helpers import checkpoint_meta

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, LENGTH = 37, 12
GIB = 2**30


def _net(**overrides) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=VOCAB, n_layers=2, d_model=32, n_heads=4, max_seq_len=LENGTH,
                               **overrides)
    return Transformer(config)


def _batch(batch: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, LENGTH), generator=torch.Generator().manual_seed(1))


def _nelbo_and_grads(network: torch.nn.Module, diffusion: AbsorbingDiffusion, x0: torch.Tensor
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss of a fixed batch (fixed times and masks) and the parameters' gradients, in
    parameter order (wrappers may rename parameters, never reorder them)."""
    network.zero_grad(set_to_none=True)
    loss = diffusion.nelbo(network, x0, generator=torch.Generator().manual_seed(2)).sum() / x0.numel()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in network.parameters()]


# ------------------------------------------------------------------ chunked cross-entropy
@pytest.mark.parametrize("chunk_rows", [1, 4, 10, 64])
def test_chunked_cross_entropy_equals_the_one_shot_loss_and_gradients(chunk_rows):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=generator, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, VOCAB, (10,), generator=generator)
    project = lambda h: F.linear(h, weight)  # noqa: E731

    one_shot = F.cross_entropy(project(hidden).float(), targets, reduction="none")
    expected = torch.autograd.grad(one_shot.sum(), [hidden, weight])
    chunked = chunked_cross_entropy(hidden, targets, project, chunk_rows)
    got = torch.autograd.grad(chunked.sum(), [hidden, weight])

    assert chunked.dtype == torch.float32 and chunked.shape == (10,)
    torch.testing.assert_close(chunked, one_shot, rtol=1e-6, atol=0)
    for grad, reference in zip(got, expected):  # a chunk's matmul may sum in another order
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-6)


def test_chunked_cross_entropy_keeps_no_logits_for_the_backward():
    """What autograd keeps between forward and backward: the one-shot path keeps the
    float32 log-softmax of every row ([N, V]); the chunked path keeps nothing that large."""
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    targets = torch.randint(0, VOCAB, (64,))
    project = lambda h: F.linear(h, weight)  # noqa: E731

    def largest_saved(loss_fn) -> int:
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            loss_fn().sum().backward()
        return max(sizes, default=0)

    assert largest_saved(lambda: F.cross_entropy(project(hidden), targets, reduction="none")) == 64 * VOCAB
    assert largest_saved(lambda: chunked_cross_entropy(hidden, targets, project, 8)) < 64 * VOCAB / 4


def test_chunked_cross_entropy_handles_no_rows_and_refuses_a_bad_chunk():
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    empty = chunked_cross_entropy(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long),
                                  lambda h: F.linear(h, weight), 4)
    assert empty.shape == (0,)
    with pytest.raises(ValueError, match="chunk_rows must be an int >= 1"):
        chunked_cross_entropy(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), lambda h: h, 0)


@pytest.mark.parametrize("time_conditioning", [False, True])
def test_transformer_returns_the_nll_of_its_own_logits(time_conditioning):
    net = _net(time_conditioning=time_conditioning)
    z, t = _batch(), torch.rand(4)
    mask = torch.rand(4, LENGTH, generator=torch.Generator().manual_seed(3)) < 0.5
    targets = _batch()[mask]
    expected = F.cross_entropy(net(z, t, output_mask=mask).float(), targets, reduction="none")
    torch.testing.assert_close(net(z, t, output_mask=mask, targets=targets, chunk_rows=3), expected,
                               rtol=1e-6, atol=0)
    # Without an output mask: one NLL per position.
    full = net(z, t, targets=_batch(), chunk_rows=5)
    torch.testing.assert_close(full, F.cross_entropy(net(z, t).float().transpose(1, 2), _batch(), reduction="none"),
                               rtol=1e-6, atol=0)


def test_chunked_nelbo_has_the_loss_and_gradients_of_the_default_path():
    net, x0 = _net(), _batch()
    schedule = make_schedule("linear")
    loss, grads = _nelbo_and_grads(net, AbsorbingDiffusion(schedule, VOCAB), x0)
    chunked_loss, chunked_grads = _nelbo_and_grads(net, AbsorbingDiffusion(schedule, VOCAB, cross_entropy_chunk_rows=5),
                                                   x0)
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-6, atol=0)
    for grad, reference in zip(chunked_grads, grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-6)


def test_chunking_leaves_denoisers_without_targets_to_the_logits_path():
    """An oracle or any (z, t) -> logits callable keeps working under a chunked diffusion."""
    logits = torch.randn(VOCAB)
    denoiser = lambda z, t: logits.expand(*z.shape, -1)  # noqa: E731
    x0 = _batch()
    chunked = AbsorbingDiffusion(make_schedule("cosine"), VOCAB, cross_entropy_chunk_rows=2)
    default = AbsorbingDiffusion(make_schedule("cosine"), VOCAB)
    assert torch.equal(chunked.nelbo(denoiser, x0, generator=torch.Generator().manual_seed(0)),
                       default.nelbo(denoiser, x0, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="cross_entropy_chunk_rows must be an int >= 0"):
        AbsorbingDiffusion(make_schedule("linear"), VOCAB, cross_entropy_chunk_rows=-1)


# ------------------------------------------------------------------ masked-position logits, attention, AdamW
class _FullLogits(torch.nn.Module):
    """A Transformer behind a plain forward (not a ``Denoiser``): the loss then asks for
    every position's logits and picks the masked rows itself."""

    def __init__(self, net: Transformer) -> None:
        super().__init__()
        self.net = net

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(z, t)


def test_logits_at_masked_positions_only_give_the_loss_of_the_full_logits():
    net, x0 = _net(), _batch()
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    loss, grads = _nelbo_and_grads(net, diffusion, x0)
    full_loss, full_grads = _nelbo_and_grads(_FullLogits(net), diffusion, x0)
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=0)
    for grad, reference in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_and_math_attention_kernels_give_the_same_loss(causal):
    """On CPU SDPA has a flash kernel too: the same loss and gradients as the math kernel."""
    net, x0 = _net(causal=causal), _batch()
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    results = {}
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
        with sdpa_kernel(backend):
            results[backend] = _nelbo_and_grads(net, diffusion, x0)
    (loss, grads), (flash_loss, flash_grads) = results.values()
    torch.testing.assert_close(flash_loss, loss, rtol=1e-5, atol=0)
    for grad, reference in zip(flash_grads, grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-4, atol=1e-6)


def test_fused_adamw_takes_the_steps_of_the_multi_tensor_path():
    """The fused kernel (on by default on GPU; CPU has one too) updates the weights as the
    default path does, weight-decay groups included."""
    x0 = _batch()
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    optim = load_config(None, {"optim.lr": "1e-2", "optim.weight_decay": "0.1"}).optim
    weights = {}
    for fused in (False, True):
        net = _net()
        optimizer = build_optimizer(net, optim, torch.device("cpu"), fused=fused)
        for seed in range(3):
            net.zero_grad(set_to_none=True)
            diffusion.nelbo(net, x0, generator=torch.Generator().manual_seed(seed)).mean().backward()
            optimizer.step()
        weights[fused] = [p.detach().clone() for p in net.parameters()]
    for fused, reference in zip(weights[True], weights[False], strict=True):
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)
    assert not torch.equal(weights[False][0], _net().embed.weight)  # the steps moved the weights


# ------------------------------------------------------------------ torch.compile
@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compile_leaves_the_loss_and_parameter_names_unchanged(checkpointing):
    """Inductor on CPU (needs a C compiler; about a minute on two cores)."""
    eager, x0 = _net(), _batch()
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB)
    loss, grads = _nelbo_and_grads(eager, diffusion, x0)
    compiled = _net()
    prepare_model(compiled, checkpointing=checkpointing, compile=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled_loss, compiled_grads = _nelbo_and_grads(compiled, diffusion, x0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # compiled, not silently eager
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=0)
    for grad, reference in zip(compiled_grads, grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-4, atol=1e-6)
    if not checkpointing:  # (checkpointing's wrapper adds its own prefix, which export strips)
        assert list(compiled.state_dict()) == list(eager.state_dict())


# ------------------------------------------------------------------ activation checkpointing "auto"
def _medium_decision(micro_batch: int, memory_bytes: float, setting: str = "auto", chunk_rows: int = 0) -> bool:
    config = load_config(None, {"train.activation_checkpointing": setting, "train.global_batch_size": "512",
                                "train.micro_batch_size": str(micro_batch),
                                "train.chunked_cross_entropy": str(chunk_rows)})
    return resolve_activation_checkpointing(config, preset("medium", 50257), plan_batches(config, 8), 1, "bf16",
                                            int(memory_bytes))


def test_activation_estimate_follows_its_stated_formula():
    network = preset("medium", 50257)
    tokens, d, v = 16 * 1024, network.d_model, network.vocab_size
    block = tokens * d * (BLOCK_FLOAT32_WIDTHS * 4 + BLOCK_ACTIVATION_WIDTHS * 2)
    head = tokens * d * (4 + 2)
    assert activation_memory_bytes(network, 16, 1024, "bf16") == 24 * block + head + tokens * v * (8 + 2)
    checkpointed = activation_memory_bytes(network, 16, 1024, "bf16", checkpointing=True)
    assert checkpointed == 24 * tokens * d * 2 + block + head + tokens * v * (8 + 2)
    chunked = activation_memory_bytes(network, 16, 1024, "bf16", chunk_rows=4096)
    assert chunked == 24 * block + head + 4096 * v * (8 + 2)
    assert activation_memory_bytes(network, 16, 1024, "fp32") > activation_memory_bytes(network, 16, 1024, "bf16")


def test_auto_checkpointing_turns_on_only_when_activations_do_not_fit_next_to_the_model_states():
    network = preset("medium", 50257)
    states = model_state_bytes(parameter_counts(network).total, 1, 8, "bf16")
    needed = states + activation_memory_bytes(network, 16, 1024, "bf16")
    threshold = needed / USABLE_MEMORY_SHARE
    assert not _medium_decision(16, threshold * 1.01)
    assert _medium_decision(16, threshold * 0.99)
    # On an 80 GiB GPU GPT-2 medium fits micro-batch 16 as is, but not 64.
    assert not _medium_decision(16, 80 * GIB) and _medium_decision(64, 80 * GIB)
    # Chunked cross-entropy frees the logits' share: the same memory then suffices.
    assert not _medium_decision(16, threshold * 0.99, chunk_rows=4096)
    # true and false are decisions already, whatever the memory.
    assert _medium_decision(1, 10**15, setting="true") and not _medium_decision(64, 10**6, setting="false")


# ------------------------------------------------------------------ config
def test_new_train_fields_are_typed_validated_and_named_in_errors(tmp_path):
    defaults = Config().train
    assert (defaults.activation_checkpointing, defaults.compile, defaults.chunked_cross_entropy) == (False, "auto", 0)
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  activation_checkpointing: auto\n  compile: true\n  chunked_cross_entropy: 2048\n")
    train = load_config(path).train
    assert (train.activation_checkpointing, train.compile, train.chunked_cross_entropy) == ("auto", True, 2048)
    assert load_config(None, {"train.activation_checkpointing": "true"}).train.activation_checkpointing is True
    cases = {
        ("train.activation_checkpointing", "sometimes"): r"--train.activation_checkpointing = 'sometimes': "
                                                          r"expected true or false, or choose one of \['auto'\]",
        ("train.compile", "fast"): r"--train.compile = 'fast': expected true or false, or choose one of \['auto'\]",
        ("train.chunked_cross_entropy", "many"): r"--train.chunked_cross_entropy = 'many': expected an integer",
        ("train.chunked_cross_entropy", "-1"): r"train.chunked_cross_entropy = -1: must be >= 0",
    }
    for (field, value), message in cases.items():
        with pytest.raises(UserError, match=message):
            load_config(None, {field: value})
    with pytest.raises(UserError, match="train.chunked_cross_entropy = 8: applies to the diffusion objective"):
        load_config(None, {"train.chunked_cross_entropy": "8", "model.objective": "autoregressive"})


def test_checkpoints_written_before_the_new_fields_are_refused_and_the_loss_chunking_is_not_resume_safe(tmp_path):
    saved = Config().to_dict()
    for field in ("compile", "chunked_cross_entropy"):
        del saved["train"][field]
    with pytest.raises(EarlierCheckpoint, match=r"written by an earlier unmask \(its config has no train.compile\)"):
        check_resumable(checkpoint_meta(saved), checkpoint_meta(Config().to_dict()), tmp_path, data_dir=tmp_path,
                        allow_config_change=True)
    assert config_differences(Config().to_dict(), load_config(None, {"train.chunked_cross_entropy": "8"}).to_dict()) \
        == ["train.chunked_cross_entropy: checkpoint 0, now 8"]


# ------------------------------------------------------------------ the benchmark
TRAIN_FIELDS = {"preset", "variant", "micro_batch", "seq_len", "vocab_size", "logit_columns", "compile", "attention",
                "step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes", "loader_wait_share"}


@pytest.mark.slow
def test_gpu_bench_smoke_runs_on_cpu_and_reports_every_field(tmp_path):
    source = require_shared(TINY, GPT2)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(source.read_text(encoding="utf-8")[:100_000], encoding="utf-8")
    variants = ["pipeline-zero1", "pipeline-zero2+no-pin+sync", "torch", "torch+chunked-ce", "torch+full-logits",
                "torch+checkpointing", "torch+math-attention+foreach-adamw", "torch+bd3-4"]
    proc = subprocess.run(
        [sys.executable, "bench/train_gpu.py", "--device", "cpu", "--presets", "tiny", "--steps", "2",
         "--warmup", "1", "--micro-batches", "2", "--seq-len", "32", "--inputs", str(corpus), "--variants",
         *variants, "--eval-blocks", "2", "--repeats", "1", "--sample-batch", "2", "--chunk-rows", "16",
         "--lm-eval-requests", "4"],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # DeepSpeed prints to stdout too: the bench's lines are the JSON objects.
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    train = [row for row in rows if row["bench"] == "train"]
    assert [row["variant"] for row in train] == variants
    assert [row["attention"] for row in train] == ["flash"] * 6 + ["math", "flash"]  # auto's CPU choice, or named
    assert [row["block_size"] for row in train] == [None] * 7 + [4]  # block diffusion: the dense mask on CPU
    for row in train:
        assert TRAIN_FIELDS <= row.keys() and row["tokens_per_s"] > 0 and row["mfu"] is None, row
        assert row["peak_memory_bytes"] is None  # CUDA only
        assert 0 < row["host_rss_bytes"] <= row["host_peak_rss_bytes"], row
        waits = row["loader_wait_share"]
        assert (0 <= waits < 1) if row["variant"].startswith("pipeline") else waits is None, row
    evaluations = [row for row in rows if row["bench"] == "evaluate"]
    assert [row["tuned"] for row in evaluations] == [False, True]  # as unmask eval ran before issue 24, and now
    for evaluation in evaluations:
        assert evaluation["estimate_tokens_per_s_per_sample"] > 0 and evaluation["seq_len"] == 32
    samples = [row for row in rows if row["bench"] == "sample"]
    assert [(row["sampler"], row["compiled"]) for row in samples] == [("ancestral", False), ("first-hitting", False)]
    for sample in samples:   # no compile on CPU
        assert sample["steps"] == 1000 and sample["sequences_per_s"] > 0
        assert sample["rows_evaluated"] <= 2 * 32  # at most one evaluation per generated token
        assert sample["utilization"] is None      # no peak on CPU
    assert samples[1]["network_calls"] == 32     # exact first-hitting: one call per token
    (lm_eval,) = [row for row in rows if row["bench"] == "lm-eval"]
    assert lm_eval["requests"] == 4 and lm_eval["requests_per_s"] > 0
