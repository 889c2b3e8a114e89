"""The GPU defaults of issue 24, proved on CPU: what torch.compile sees (no graph break, a
bounded number of graphs over varying mask counts, the eager loss), the padded vocabulary
(the true loss, logits and gradients), the micro-batch, evaluation batch and attention
choices, the EMA's fused update, and the host reads of a training micro-step.

Compilation here uses dynamo's counting backends ("eager", "aot_eager": graphs captured,
AOT autograd's backward included, no inductor code generation), so the tests stay fast."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from common.errors import UserError
from common.units import GIB
from evaluation.bounds.scoring import CPU_BATCH_SIZE, default_batch_size
from evaluation.inference import COMPILE_MIN_TOKENS, should_compile
from model.absorbing import AbsorbingDiffusion
from model.cross_entropy import CompiledCrossEntropy
from model.schedules import make_schedule
from model.spec import ModelSpec
from model.transformer import ROW_MULTIPLE, Transformer, TransformerConfig, parameter_counts, preset, unpadded_state
from pipeline.config import Config, config_differences, load_config
from pipeline.run_dir.checkpoint import EarlierCheckpoint
from pipeline.run_dir.resume import check_resumable
from pipeline.training.attention import attention_kernel, available_kernels, resolve_attention
from pipeline.training.ema import EMA, ema_decay
from pipeline.training.engine import (
    USABLE_MEMORY_SHARE,
    activation_memory_bytes,
    choose_inference_batch,
    choose_micro_batch,
    deepspeed_config,
    inference_memory_bytes,
    model_state_bytes,
    plan_training,
)
from pipeline.training.objective import MicroBatchSlot, make_objective
from tests.support.train_helpers import checkpoint_meta

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, LENGTH, WIDTH, BATCH = 37, 64, 32, 4
PADDED = 16  # vocab_multiple of the padded networks: 37 -> 48 logit columns, 38 -> 48 embedding rows

REPO = Path(__file__).resolve().parents[3]


def _net(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(vocab_size=VOCAB, n_layers=2, d_model=WIDTH, n_heads=4, max_seq_len=LENGTH,
                                         **overrides))


def _batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(network: torch.nn.Module, diffusion: AbsorbingDiffusion, x0: torch.Tensor, seed: int = 2):
    network.zero_grad(set_to_none=True)
    loss = diffusion.nelbo(network, x0, generator=torch.Generator().manual_seed(seed)).sum() / x0.numel()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in network.named_parameters()}


# ------------------------------------------------------------------ compile
@pytest.mark.parametrize("time_conditioning", [False, True])
def test_a_block_and_the_head_with_its_loss_compile_without_graph_breaks(time_conditioning):
    net = _net(time_conditioning=time_conditioning, vocab_multiple=PADDED)
    x, t = torch.randn(2, LENGTH, WIDTH), torch.rand(2)
    explained = torch._dynamo.explain(net.blocks[0])(x, net._condition(x[..., 0].long(), t))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    loss = CompiledCrossEntropy(net._padded_logits, ROW_MULTIPLE, backend="eager")
    hidden = torch.randn(2 * ROW_MULTIPLE, WIDTH, requires_grad=True)
    targets = torch.randint(0, VOCAB, (2 * ROW_MULTIPLE,))
    for name, function in loss.functions.items():
        for tensor in (hidden, targets):  # as CompiledCrossEntropy marks them
            torch._dynamo.mark_dynamic(tensor, 0)
        explained = torch._dynamo.explain(function)(hidden, targets)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (name, explained.break_reasons)


@pytest.mark.parametrize("chunk_rows", [0, 48])
def test_fifty_steps_of_varying_mask_counts_compile_two_graphs(chunk_rows):
    """One graph for the blocks (all of them), one for the head and loss, whatever the number
    of masked rows: from none (t = 0) to every position (t near 1)."""
    torch._dynamo.reset()
    net = _net(vocab_multiple=PADDED)
    counter = CompileCounterWithBackend("aot_eager")
    net.compile_parts(backend=counter)
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, validate=False, cross_entropy_chunk_rows=chunk_rows)
    x0, counts = _batch(), set()
    for step in range(50):
        t = torch.full((BATCH,), step / 49, dtype=torch.float64)  # 0 to 1: none to all of the 256 positions
        terms = diffusion.nelbo_terms(net, x0, t, torch.Generator().manual_seed(100 + step), reconstruction="uniform")
        terms.total.sum().backward()
        counts.add(int(terms.num_masked.sum()))
    assert 0 in counts and len(counts) >= 40 and max(counts) > 3 * ROW_MULTIPLE  # the row count did vary
    assert counter.frame_count == 2
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("chunk_rows", [0, 48])
def test_the_compiled_loss_and_gradients_are_the_eager_ones(chunk_rows):
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, cross_entropy_chunk_rows=chunk_rows)
    eager, compiled, x0 = _net(vocab_multiple=PADDED), _net(vocab_multiple=PADDED), _batch()
    torch._dynamo.reset()
    compiled.compile_parts(backend="aot_eager")
    loss, grads = _loss_and_grads(eager, diffusion, x0)
    compiled_loss, compiled_grads = _loss_and_grads(compiled, diffusion, x0)
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


# ------------------------------------------------------------------ vocabulary padding
HEADS = {"tied": {}, "untied": {"tie_weights": False},
         "untied+bias+mask row": {"tie_weights": False, "head_bias": True, "head_mask_row": True}}


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("chunk_rows", [0, 5])
def test_a_padded_vocabulary_gives_the_true_loss_logits_and_gradients(head, chunk_rows):
    plain, padded = _net(**HEADS[head]), _net(vocab_multiple=PADDED, **HEADS[head])
    assert padded.embed.weight.shape[0] == 48 and padded.config.logit_columns == 48
    # The same draws: every true row and every other weight is the unpadded network's, the padding 0.
    padded_state = padded.state_dict()
    for name, tensor in plain.state_dict().items():
        rows = tensor.shape[0] if tensor.dim() else 0
        assert torch.equal(padded_state[name][:rows], tensor) and not padded_state[name][rows:].any(), name
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, cross_entropy_chunk_rows=chunk_rows)
    x0 = _batch()
    loss, grads = _loss_and_grads(plain, diffusion, x0)
    padded_loss, padded_grads = _loss_and_grads(padded, diffusion, x0)
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        rows = grad.shape[0]
        torch.testing.assert_close(padded_grads[name][:rows], grad, rtol=1e-5, atol=1e-7, msg=name)
        assert not padded_grads[name][rows:].any(), f"{name}: a padded row got a gradient"
    with torch.no_grad():
        logits = padded(x0)
    assert logits.shape == (BATCH, LENGTH, VOCAB)
    torch.testing.assert_close(logits, plain(x0).detach(), rtol=1e-6, atol=1e-6)
    # What an export holds: the unpadded network's tensors, which load into it.
    unpadded = unpadded_state(padded.state_dict(), padded.config)
    assert {name: tuple(t.shape) for name, t in unpadded.items()} == \
        {name: tuple(t.shape) for name, t in plain.state_dict().items()}
    assert parameter_counts(padded.config).total == sum(p.numel() for p in padded.parameters())


def test_the_uniform_process_scores_a_padded_network_as_the_true_one():
    """The uniform bound uses the whole prediction over the vocabulary: it must see V columns."""
    from model.uniform import UniformDiffusion

    plain, padded = _net(time_conditioning=True), _net(time_conditioning=True, vocab_multiple=PADDED)
    diffusion = UniformDiffusion(make_schedule("linear"), VOCAB)
    loss, grads = _loss_and_grads(plain, diffusion, _batch())
    padded_loss, padded_grads = _loss_and_grads(padded, diffusion, _batch())
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=0)
    assert not padded_grads["embed.weight"][VOCAB + 1:].any()


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


# ------------------------------------------------------------------ micro-batch and evaluation batch
MEDIUM = preset("medium", 50257, vocab_multiple=128)


def _medium(**overrides) -> Config:
    return load_config(None, {"model.preset": "medium", "train.global_batch_size": "512",
                              **{k: str(v) for k, v in overrides.items()}})


def _fits(micro: int, memory: float, world: int = 1, checkpointing: bool = False) -> bool:
    states = model_state_bytes(parameter_counts(MEDIUM).total, 1, world, "bf16")
    return states + activation_memory_bytes(MEDIUM, micro, 1024, "bf16", checkpointing=checkpointing) \
        <= USABLE_MEMORY_SHARE * memory


def test_auto_micro_batch_is_the_largest_the_memory_estimate_fits():
    h100, h200 = 80 * GIB, 141 * GIB
    assert choose_micro_batch(_medium(), MEDIUM, 1, 1, "bf16", h100) == (32, False)
    assert choose_micro_batch(_medium(), MEDIUM, 1, 1, "bf16", h200) == (64, False)
    assert choose_micro_batch(_medium(), MEDIUM, 8, 1, "bf16", h100) == (32, False)  # 64 sequences per rank
    # Just below what 32 needs: 16; just above: 32.
    edge = next(memory for memory in range(40 * GIB, 80 * GIB, GIB // 16) if _fits(32, memory))
    assert choose_micro_batch(_medium(), MEDIUM, 1, 1, "bf16", edge) == (32, False)
    assert choose_micro_batch(_medium(), MEDIUM, 1, 1, "bf16", edge - GIB // 16) == (16, False)
    # A divisor of the rank's share of the global batch: 48 sequences and room for about 20 -> 16.
    room_for_20 = next(memory for memory in range(GIB, 80 * GIB, GIB // 16) if _fits(20, memory))
    assert choose_micro_batch(_medium(**{"train.global_batch_size": 48}), MEDIUM, 1, 1, "bf16", room_for_20) \
        == (16, False)
    # Where not one sequence fits without activation checkpointing, "auto" turns it on ...
    tight = next(memory for memory in range(GIB, 80 * GIB, GIB // 16) if _fits(1, memory, checkpointing=True))
    assert not _fits(1, tight)
    micro, checkpointing = choose_micro_batch(_medium(**{"train.activation_checkpointing": "auto"}), MEDIUM, 1, 1,
                                              "bf16", tight)
    assert checkpointing and micro >= 1 and _fits(micro, tight, checkpointing=True)
    # ... which "false" does not (nothing fits: 1), and "true" fits more sequences than without.
    assert choose_micro_batch(_medium(), MEDIUM, 1, 1, "bf16", tight) == (1, False)
    with_checkpointing = choose_micro_batch(_medium(**{"train.activation_checkpointing": "true"}), MEDIUM, 1, 1,
                                            "bf16", h100)
    assert with_checkpointing[1] and with_checkpointing[0] > 32


def test_off_gpu_auto_keeps_the_whole_rank_batch_and_compile_and_attention_resolve():
    config = load_config(None, {"train.global_batch_size": "16"})
    assert (config.train.micro_batch_size, config.train.compile, config.train.attention) == ("auto", "auto", "auto")
    plan = plan_training(config, preset("tiny", 64, vocab_multiple=128), 2, torch.device("cpu"))
    assert (plan.batches.micro_batch, plan.batches.accumulation, plan.compile, plan.attention) == (8, 1, False, "flash")
    assert plan_training(load_config(None, {"train.compile": "true", "train.attention": "math"}), preset("tiny", 64),
                         1, torch.device("cpu")).attention == "math"
    # A single rank has no one to overlap communication with; a bucket is GRADIENT_BUCKET_ELEMENTS.
    zero = deepspeed_config(plan, config.optim)["zero_optimization"]
    assert zero["stage"] == 1 and zero["overlap_comm"] is False and zero["contiguous_gradients"] is True
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 50_000_000
    with pytest.raises(UserError, match=r"train.micro_batch_size = 5: must divide train.global_batch_size = 16"):
        load_config(None, {"train.global_batch_size": "16", "train.micro_batch_size": "5"})


def test_the_evaluation_batch_is_sized_to_the_device():
    assert default_batch_size(MEDIUM, 1024, torch.device("cpu")) == CPU_BATCH_SIZE
    batch = choose_inference_batch(MEDIUM, 1024, "bf16", 80 * GIB, 256)
    assert batch & (batch - 1) == 0 and 16 <= batch < 256  # a power of two, the estimate's largest
    assert inference_memory_bytes(MEDIUM, batch, 1024, "bf16") <= USABLE_MEMORY_SHARE * 80 * GIB
    assert inference_memory_bytes(MEDIUM, 2 * batch, 1024, "bf16") > USABLE_MEMORY_SHARE * 80 * GIB
    assert choose_inference_batch(MEDIUM, 1024, "bf16", 10**15, 256) == 256
    assert choose_inference_batch(MEDIUM, 1024, "bf16", GIB, 256) == 1


def test_compile_auto_is_on_for_a_gpu_when_the_work_repays_it_and_on_or_off_as_told():
    """``unmask eval --compile``, ``unmask sample --compile`` and a plan's ``compile``."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # device objects only: nothing runs on them
    assert not should_compile("auto", cpu, 10**12)
    assert should_compile("auto", cuda, COMPILE_MIN_TOKENS) and not should_compile("auto", cuda, COMPILE_MIN_TOKENS - 1)
    assert should_compile("on", cpu, 1) and not should_compile("off", cuda, 10**12)
    with pytest.raises(ValueError, match="compile must be one of auto, on, off"):
        should_compile("yes", cpu, 1)


# ------------------------------------------------------------------ attention
def test_attention_auto_picks_a_kernel_that_runs_and_a_named_one_that_does_not_is_refused():
    cpu = torch.device("cpu")
    assert resolve_attention("auto", cpu, torch.float32, 64) == "flash"
    assert resolve_attention("auto", cpu, torch.float32, 64, dropout=0.1) == "math"  # CPU flash takes no dropout
    assert resolve_attention("math", cpu, torch.float32, 64) == "math"
    for kernel in ("cudnn", "efficient"):
        with pytest.raises(UserError, match=rf"^config field train.attention = {kernel}: this kernel does not run on "
                                            r"CPU at float32 with head size 64; choose auto or one that runs here: "
                                            r"flash, math$"):
            resolve_attention(kernel, cpu, torch.float32, 64)
    with pytest.raises(UserError, match=r"--train.attention = 'fast': choose one of \['auto', 'cudnn', 'flash', "
                                        r"'efficient', 'math'\]"):
        load_config(None, {"train.attention": "fast"})


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode, torch.enable_grad])
def test_the_kernel_probe_answers_the_same_in_every_grad_mode_of_its_caller(grad_mode):
    # evaluation, sampling and lm-eval probe inside no_grad/inference_mode (issue 30: every probe failed there).
    cpu = torch.device("cpu")
    with grad_mode():
        before = torch.is_grad_enabled()
        for backward in (True, False):
            assert resolve_attention("auto", cpu, torch.float32, 64, backward=backward) == "flash"
            assert resolve_attention("auto", cpu, torch.float32, 64, dropout=0.1, backward=backward) == "math"
            assert available_kernels(cpu, torch.float32, 64, backward=backward) == ["flash", "math"]
        assert torch.is_grad_enabled() == before   # the probe's own mode does not leak into the caller's


@pytest.mark.filterwarnings("ignore:.*kernel not used because:UserWarning")  # SDPA says why it refuses
def test_the_chosen_kernel_is_the_only_one_sdpa_may_use():
    q = torch.randn(1, 2, 8, 16)
    with attention_kernel("math"):
        math_out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    with attention_kernel("flash"):
        torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(q, q, q), math_out)
    with attention_kernel("efficient"), pytest.raises(RuntimeError, match="No viable backend"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q)  # none on CPU: restricted, not SDPA's choice


# ------------------------------------------------------------------ step overhead
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_ema_update_is_the_per_parameter_lerp(dtype):
    net = _net().to(dtype)
    ema = EMA(net, 0.99, warmup=True)
    reference = {name: p.detach().float().clone() for name, p in net.named_parameters()}
    for update in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        weight = 1.0 - ema_decay(0.99, update, True)
        reference = {name: torch.lerp(reference[name], p.detach().float(), weight)
                     for name, p in net.named_parameters()}
    for name, value in reference.items():
        assert torch.equal(ema.shadow[name], value), name


# Ops whose result the host must read back (on a GPU, each waits for the queued work).
HOST_READS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::masked_select",
              "aten::equal", "aten::unique_consecutive", "aten::_unique2"}
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"}


class _HostReads(TorchDispatchMode):
    """Every host read of the ops run inside it, with the function of ours that made it, and
    the number of matmuls run before it."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str, int]] = []
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in HOST_READS:
            ours = [f for f in traceback.extract_stack()
                    if f.filename.startswith(str(REPO)) and "/tests/" not in f.filename
                    and "site-packages" not in f.filename]  # CI's .venv lies inside REPO
            where = f"{Path(ours[-1].filename).relative_to(REPO)}:{ours[-1].name}" if ours else "?"
            self.reads.append((name, where, self.matmuls))
        self.matmuls += name in MATMULS
        return func(*args, **(kwargs or {}))


def test_a_training_micro_step_reads_the_device_only_for_the_masked_count_before_any_matmul():
    """The objective's loss, its backward and the EMA update as the trainer runs them on a GPU
    (validate=False): the only reads of device data are the masked positions' count (one
    nonzero in the bound, one in the network, both before the first matmul of the forward, so
    the device never drains mid-step); the schedule's endpoint rate is read from a host tensor."""
    spec = ModelSpec(network=_net().config)
    objective = make_objective(spec, validate=False)
    net = _net()
    ema = EMA(net, 0.99)
    slot = MicroBatchSlot(seed=0, step=3, rank=0, world_size=1, micro=0, micro_batches=1)
    with _HostReads() as reads:
        loss_sum = objective.loss_sum(net, _batch(), slot)
        (loss_sum / (BATCH * LENGTH)).backward()
        ema.update()
    assert reads.matmuls > 0
    assert sorted({(name, where) for name, where, _ in reads.reads}) == [
        ("aten::_local_scalar_dense", "model/absorbing.py:_endpoint_masking_rate"),  # a host tensor (t = 0)
        # The schedule's checks of its input: the step's times, made on the host.
        ("aten::_local_scalar_dense", "model/checks.py:check_schedule_times"),
        ("aten::nonzero", "model/absorbing.py:masked_nll"),
        ("aten::nonzero", "model/transformer.py:_selected_rows")]
    assert [matmuls for name, _, matmuls in reads.reads if name == "aten::nonzero"] == [0, 0]


# ------------------------------------------------------------------ the device of every command
@pytest.mark.parametrize("gpu", [True, False])
def test_every_command_runs_on_the_gpu_when_there_is_one_unless_told_otherwise(monkeypatch, gpu):
    from evaluation.downstream import lm_eval_model
    from evaluation.inference import resolve_device
    from orchestration.cli import build_parser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    expected = torch.device("cuda" if gpu else "cpu")
    assert resolve_device(None) == expected and lm_eval_model._device(None) == expected
    assert resolve_device("cpu") == torch.device("cpu")
    commands = build_parser()._subparsers._group_actions[0].choices
    with_device = {name: action for name, command in commands.items() for action in command._actions
                   if "--device" in action.option_strings}
    assert {"sample", "eval", "lm-eval"} <= with_device.keys()
    for name, action in with_device.items():   # unset, so that resolve_device decides
        assert action.default is None and "cuda when there is one" in action.help, name


def test_forward_flops_count_the_head_only_where_logits_are_computed():
    from pipeline.training.throughput import flops_per_token, forward_flops

    config = preset("small", 50257)
    full = forward_flops(config, 1024, tokens=1000, head_rows=1000)   # every row: the forward convention,
    # less the embedding's mask row, which N counts and the head never computes
    assert full == pytest.approx(1000 * (flops_per_token(config, 1024) / 3 - 2 * 768), rel=1e-12)
    half = forward_flops(config, 1024, tokens=1000, head_rows=500)
    assert full - half == pytest.approx(500 * 2 * 768 * 50257)
