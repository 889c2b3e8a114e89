"""Correctness on a CUDA GPU (marker ``gpu``; skipped, with the reason, on a machine without one).

What only a GPU exercises: bf16 autocast against float32 on the same batch, the flash
attention kernel, NCCL, ``train.compile`` with Triton kernels, and the evaluation bound
under bf16 against float32 on the same weights; the GPU defaults: compile "auto" (blocks,
head and loss, a bounded number of graphs), the attention kernels SDPA offers here (cuDNN,
flash) and "auto"'s choice, the padded vocabulary under bf16, the host syncs of a training
micro-step, the objective through the engine's edge, sampling under bf16, the weights of
``--init-from`` loaded before the device; block diffusion's FlexAttention training step and
its KV-cache sampler, and an imported BD3-LM model's logits against BD3-LM's own; the compiled
activation estimate against the GPU's peak, and FP8 (``train.float8``): planned or refused by
compute capability, and its loss curve against bf16's. ``make


its KV-cache sampler, document masking's FlexAttention step (MDLM, blocks, AR) against its dense
mask, and an imported BD3-LM model's logits against BD3-LM's own. ``make
gpu-check`` runs these and the GPU benchmark in one command; ``bench/gpu_check.sh`` runs them
on a lent device (docs/performance.md).
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from evaluation.bounds.estimator import estimate_bound, wrap_blocks
from evaluation.inference import inference_mode
from model.absorbing import AbsorbingDiffusion
from model.sampling import MAX_STEPS_PER_POSITION, PlanError, SamplingPlan, sample_generators
from model.schedules import make_schedule
from model.spec import ModelSpec
from model.transformer import Transformer, preset
from pipeline.config import load_config
from pipeline.training.attention import AUTO_ORDER, attention_kernel, kernel_runs, resolve_attention
from pipeline.training.ema import EMA
from pipeline.training.engine import plan_training, prepare_model
from pipeline.training.objective import MicroBatchSlot, make_objective
from tests.support.cli_runner import DISTRIBUTED_ENV, cli_env
from tests.support.paths import REPO

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")]

VOCAB, LENGTH, BATCH = 50257, 256, 8
# bf16 keeps 8 bits of mantissa: a loss of ~10 nats agrees with float32 to a few 1e-3.
BF16_LOSS_RTOL = 1e-2
COMPILE_LOSS_RTOL = 1e-3
# |bf16 - fp32| of the evaluation bound, in units of its standard error.
EVAL_Z_LIMIT = 3.0


def _network(block_attention: str = "dense", **overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(preset("small", VOCAB, max_seq_len=LENGTH, **overrides), block_attention).cuda()


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1)).cuda()


def _loss(network: torch.nn.Module, x0: torch.Tensor, *, bf16: bool) -> torch.Tensor:
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, validate=False)
    t = torch.linspace(0.05, 0.95, BATCH, dtype=torch.float64)
    generator = torch.Generator(device="cuda").manual_seed(2)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        return diffusion.nelbo(network, x0, t=t, generator=generator).sum() / x0.numel()


def test_bf16_autocast_loss_is_the_fp32_loss_within_bf16_rounding():
    network, x0 = _network(), _batch()
    with torch.no_grad():
        fp32, bf16 = _loss(network, x0, bf16=False), _loss(network, x0, bf16=True)
    assert torch.isfinite(bf16)
    torch.testing.assert_close(bf16, fp32, rtol=BF16_LOSS_RTOL, atol=0)


def test_flash_attention_runs_and_matches_the_default_kernel():
    network, x0 = _network(), _batch()
    with torch.no_grad():
        default = _loss(network, x0, bf16=True)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if flash cannot take these inputs
            flash = _loss(network, x0, bf16=True)
    torch.testing.assert_close(flash, default, rtol=BF16_LOSS_RTOL, atol=0)


def test_nccl_initializes_a_world_of_one():
    """What `unmask train` does alone: DeepSpeed joins a world of one on NCCL; at shutdown the
    process keeps none of the launcher variables it set for itself."""
    script = ("import os, torch, torch.distributed as d; from pipeline.distributed import init_distributed;"
              "g = init_distributed(); t = torch.ones(1, device=g.device); d.all_reduce(t); g.shutdown();"
              "print(g.backend, d.get_backend(), int(t.item()), 'MASTER_PORT' in os.environ)")
    env = {name: value for name, value in cli_env().items() if name not in DISTRIBUTED_ENV}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-4:] == ["nccl", "nccl", "1", "False"]


def test_compile_auto_is_on_and_the_compiled_blocks_head_and_loss_give_the_eager_loss_and_gradients():
    plan = plan_training(load_config(None, {"model.preset": "small", "train.global_batch_size": str(BATCH)}),
                         _network().config, 1, torch.device("cuda"))
    assert plan.compile and plan.precision == "bf16"
    x0 = _batch()
    eager, compiled = _network(), _network()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    prepare_model(compiled, checkpointing=False, compile=plan.compile)
    losses, grads = [], []
    for network in (eager, compiled):
        loss = _loss(network, x0, bf16=True)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten().float() for p in network.parameters()]))
    torch.testing.assert_close(losses[1], losses[0], rtol=COMPILE_LOSS_RTOL, atol=0)
    cosine = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert cosine > 0.999
    # Mask counts on both sides of the first one warm the cache up: torch compiles a graph for the
    # first count, and a size it guarded on that then changes compiles once more (dynamo's automatic
    # dynamic shapes; on CUDA inductor also guards its reduction strategy on the rows against the
    # SMs). The H200 showed 3 graphs on 2026-11-27 where CPU inductor and aot_eager show 2: blocks,
    # head with loss, and one recompile for another count. The promise is that it stops there: no
    # compile per step, whatever the count. On failure, dynamo's recompile reasons say which guard.
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, validate=False)

    def step(t_value: float, seed: int) -> None:
        t = torch.full((BATCH,), t_value, dtype=torch.float64)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            diffusion.nelbo(compiled, x0, t, torch.Generator("cuda").manual_seed(seed),
                            reconstruction="uniform").sum().backward()

    for seed, t_value in enumerate((0.02, 0.98)):   # the fewest and the most masked rows
        step(t_value, seed)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 2 <= graphs <= 3, _recompile_reasons()
    for seed in range(6):
        step((seed + 0.5) / 6, seed)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, _recompile_reasons()


def _recompile_reasons() -> dict[str, list[str]]:
    """Why dynamo compiled a function again: its failed guards, by function name."""
    return {code.co_name: [str(reason) for reason in reasons]
            for code, reasons in torch._dynamo.utils.guard_failures.items()}


def test_every_attention_kernel_that_runs_gives_the_default_loss_and_auto_picks_the_first_that_runs():
    runs = [name for name in AUTO_ORDER["cuda"] if kernel_runs(name, torch.device("cuda"), torch.bfloat16, 64)]
    assert "flash" in runs  # Ampere and later
    if torch.cuda.get_device_capability() >= (9, 0):
        assert "cudnn" in runs  # Hopper: cuDNN's fused attention, auto's choice
    assert resolve_attention("auto", torch.device("cuda"), torch.bfloat16, 64) == runs[0]
    network, x0 = _network(), _batch()
    with torch.no_grad():
        default = _loss(network, x0, bf16=True)
        for name in runs:
            with attention_kernel(name):
                torch.testing.assert_close(_loss(network, x0, bf16=True), default, rtol=BF16_LOSS_RTOL, atol=0,
                                           msg=name)


def test_a_padded_vocabulary_gives_the_unpadded_loss_under_bf16_and_no_gradient_to_its_rows():
    plain, padded, x0 = _network(), _network(vocab_multiple=128), _batch()
    assert padded.embed.weight.shape[0] == 50304 and padded.config.logit_columns == 50304
    losses = {}
    for name, network in (("plain", plain), ("padded", padded)):
        loss = _loss(network, x0, bf16=True)
        loss.backward()
        losses[name] = loss.detach()
    torch.testing.assert_close(losses["padded"], losses["plain"], rtol=BF16_LOSS_RTOL, atol=0)
    assert not padded.embed.weight.grad[VOCAB + 1:].any()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert padded(x0).shape == (BATCH, LENGTH, VOCAB)


def test_a_training_micro_step_syncs_the_host_only_before_its_first_matmul():
    """Every synchronizing CUDA call of the objective's loss, its backward and the EMA update
    (as torch.cuda.set_sync_debug_mode reports them) comes before the forward's first matmul:
    the times' copy to the device, their range check, the masked count and the selected rows
    (``pipeline/training/objective.py``, ``model/checks.py``, ``model/absorbing.py``,
    ``model/transformer.py``); the device never drains in the middle of a step.

    How the order is read: torch turns the sync warning into a Python warning when the Python
    call that caused it returns (on torch 2.11 not inside a dispatch mode's call, where the
    first version of this test looked and saw nothing), so the warnings arrive in program order
    and a dispatch mode notes how many had arrived when the first matmul ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class FirstMatmul(TorchDispatchMode):
        def __init__(self, caught: list) -> None:
            super().__init__()
            self.caught, self.before = caught, None   # warnings recorded when the first matmul ran

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.before is None and func._schema.name in ("aten::mm", "aten::addmm", "aten::bmm"):
                self.before = len(self.caught)
            return func(*args, **(kwargs or {}))

    network = _network()
    objective = make_objective(ModelSpec(network=network.config), validate=False)
    ema = EMA(network, 0.99)
    slot = MicroBatchSlot(seed=0, step=3, rank=0, world_size=1, micro=0, micro_batches=1)
    x0 = _batch()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with FirstMatmul(caught) as first, torch.autocast("cuda", dtype=torch.bfloat16):
                loss_sum = objective.loss_sum(network, x0, slot)
                (loss_sum / x0.numel()).backward()
                ema.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [(index, f"{Path(w.filename).name}:{w.lineno}") for index, w in enumerate(caught)
             if "synchronizing CUDA operation" in str(w.message)]
    assert first.before is not None and syncs, "sync debug mode reported nothing: is it on?"
    assert all(index < first.before for index, _ in syncs), (
        f"syncs after the first matmul: {[where for index, where in syncs if index >= first.before]}; "
        f"all: {[where for _, where in syncs]}")


@pytest.mark.parametrize("process", ["absorbing", "block", "learned"])
def test_the_objective_through_the_engine_s_edge_gives_the_bare_network_s_loss_under_bf16(process):
    """The training loss as the trainer computes it on a GPU: the objective called with the
    engine as ``engine_model`` hands it over (the network's forward through its wrapper, the
    masked NLL computed inside the network's forward) gives the loss of the bare network, bit
    for bit, and the same gradients: the wrapper adds nothing to the NELBO's computation."""
    from model.spec import build_trainable
    from pipeline.config import ModelSection
    from pipeline.training.objective import engine_model

    class Engine(torch.nn.Module):  # DeepSpeed's engine as the objective sees it: forward calls, .module
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    section = {"absorbing": ModelSection(), "block": ModelSection(block_size=16),
               "learned": ModelSection(process="learned")}[process]
    spec = section.spec(preset("small", VOCAB, max_seq_len=LENGTH))
    slot = MicroBatchSlot(seed=0, step=3, rank=0, world_size=1, micro=0, micro_batches=1)
    x0, losses, grads = _batch(), [], []
    for wrapped in (False, True):
        torch.manual_seed(0)
        module = build_trainable(spec, validate=False, block_attention="flex").cuda()
        objective = make_objective(spec, validate=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = objective.loss_sum(engine_model(Engine(module)) if wrapped else module, x0, slot)
        (loss / x0.numel()).backward()
        losses.append(loss.detach())
        grads.append(next(p.grad for p in module.parameters() if p.grad is not None).float())
    assert torch.isfinite(losses[0])
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_the_evaluation_bound_under_bf16_is_the_fp32_bound_within_its_standard_error():
    network = _network().eval()
    generator = torch.Generator().manual_seed(3)
    documents = [torch.randint(0, VOCAB, (300,), generator=generator).tolist() for _ in range(16)]
    blocks = wrap_blocks(documents, LENGTH, eos_id=VOCAB - 1, pad_id=0)
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, validate=False)
    estimates = {}
    for bf16 in (False, True):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            estimates[bf16] = estimate_bound(diffusion, network, blocks, samples_per_block=8, seed=0,
                                             batch_size=8, device="cuda")
    fp32, bf16 = estimates[False], estimates[True]
    assert abs(bf16.nelbo_per_token - fp32.nelbo_per_token) < EVAL_Z_LIMIT * fp32.standard_error


def test_bd3lm_framed_blocks_score_all_but_the_bos_under_bf16_as_under_fp32():
    """``--protocol bd3lm`` on a GPU: BOS chunk EOS blocks without an EOS between rows, the BOS
    never masked nor scored (``positions``), the bf16 bound the fp32 one within its error."""
    from evaluation.bounds.protocols import BD3LM

    network = _network().eval()
    generator = torch.Generator().manual_seed(4)
    documents = [torch.randint(0, VOCAB - 1, (200,), generator=generator).tolist() for _ in range(16)]
    wrapped = BD3LM.wrap(documents, LENGTH, bos_id=VOCAB - 1, eos_id=VOCAB - 1, pad_id=0)
    blocks = wrapped.blocks
    assert not blocks.positions[:, 0].any() and bool(blocks.positions[:, 1:].all())
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, validate=False)
    estimates = {}
    for bf16 in (False, True):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            estimates[bf16] = estimate_bound(diffusion, network, blocks, samples_per_block=8, seed=0,
                                             batch_size=8, device="cuda")
    fp32, bf16 = estimates[False], estimates[True]
    assert fp32.num_tokens == bf16.num_tokens == blocks.tokens.shape[0] * (LENGTH - 1)
    assert abs(bf16.nelbo_per_token - fp32.nelbo_per_token) < EVAL_Z_LIMIT * fp32.standard_error


def test_first_hitting_sampling_runs_under_bf16_one_call_per_token():
    """As ``unmask sample`` runs on a GPU (``evaluation.generation.generate``): inference mode, bf16
    autocast and the attention kernel of evaluation (compiled sampling is tested on CPU; a
    compile here would cost the GPU check's time limit)."""
    network, device, samples, length = _network().eval(), torch.device("cuda"), 4, 64
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, validate=False)
    plan = SamplingPlan(sampler="first-hitting", seed=0)
    with torch.inference_mode(), inference_mode(network, device):
        tokens, stats = diffusion.sample(network, plan, num_samples=samples, seq_len=length, window=LENGTH,
                                         generator=sample_generators(plan.seed, range(samples)), device=device)
    assert tokens.shape == (samples, length) and 0 <= int(tokens.min()) and int(tokens.max()) < VOCAB
    assert list(stats.row_calls) == [length] * samples  # exact first-hitting: one call per token


def test_threshold_decoding_and_the_prefix_cache_run_under_bf16_and_a_cache_refreshed_every_call_is_exact():
    """Fast generation as ``unmask sample`` runs it on a GPU (docs/fast-generation.md): threshold
    decoding reveals at least one token a call; blocks with the prefix cache refreshed at every call
    draw the uncached samples, refreshed every 4 calls the same number of calls; guidance at w = 0
    draws the unguided samples at twice the calls."""
    from model.sampling import ThresholdOptions

    network, device, samples, length = _network().eval(), torch.device("cuda"), 4, LENGTH + 64
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, validate=False)
    prompt = torch.full((length,), VOCAB, device=device)
    prompt[:8] = torch.arange(8, device=device)

    def draw(plan: SamplingPlan):
        with torch.inference_mode(), inference_mode(network, device):
            return diffusion.sample(network, plan, num_samples=samples, seq_len=length, window=LENGTH, prompt=prompt,
                                    generator=sample_generators(plan.seed, range(samples)), device=device)

    tokens, stats = draw(SamplingPlan(sampler="threshold", options=ThresholdOptions(threshold=0.5), block_len=64))
    assert int(tokens.max()) < VOCAB and all(1 <= calls <= length - 8 for calls in stats.row_calls)
    blocks = SamplingPlan(sampler="confidence", steps=16, block_len=64, seed=1)
    plain, plain_stats = draw(blocks)
    exact, exact_stats = draw(SamplingPlan(**{**blocks.__dict__, "prefix_cache": 1}))
    assert torch.equal(exact, plain) and exact_stats == plain_stats
    cached, cached_stats = draw(SamplingPlan(**{**blocks.__dict__, "prefix_cache": 4}))
    assert int(cached.max()) < VOCAB and cached_stats.row_calls == plain_stats.row_calls
    guided, guided_stats = draw(SamplingPlan(**{**blocks.__dict__, "guidance": 0.0}))
    assert torch.equal(guided, plain) and guided_stats.network_calls == 2 * plain_stats.network_calls


def test_whole_sequence_blocks_and_the_dual_cache_run_under_bf16_and_a_cache_refreshed_every_call_is_exact():
    """Whole-sequence blocks as ``unmask sample --whole-sequence`` runs them on a GPU
    (docs/fast-generation.md): no mask left, the prompt kept; the dual cache refreshed at every
    call draws the uncached samples at the same calls, refreshed every 4 calls the same calls; with
    guidance at w = 0 (its unprompted pass on its own cache) the same samples at twice the calls."""
    network, device, samples = _network().eval(), torch.device("cuda"), 4
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, validate=False)
    prompt = torch.full((LENGTH,), VOCAB, device=device)
    prompt[:8] = torch.arange(8, device=device)

    def draw(plan: SamplingPlan):
        with torch.inference_mode(), inference_mode(network, device):
            return diffusion.sample(network, plan, num_samples=samples, seq_len=LENGTH, window=LENGTH, prompt=prompt,
                                    generator=sample_generators(plan.seed, range(samples)), device=device)

    blocks = SamplingPlan(sampler="confidence", steps=16, block_len=64, seed=1, whole_sequence=True)
    plain, plain_stats = draw(blocks)
    assert int(plain.max()) < VOCAB and torch.equal(plain[:, :8], prompt[:8].expand(samples, -1))
    exact, exact_stats = draw(SamplingPlan(**{**blocks.__dict__, "dual_cache": 1}))
    assert torch.equal(exact, plain) and exact_stats == plain_stats
    cached, cached_stats = draw(SamplingPlan(**{**blocks.__dict__, "dual_cache": 4}))
    assert int(cached.max()) < VOCAB and cached_stats.row_calls == plain_stats.row_calls
    guided, guided_stats = draw(SamplingPlan(**{**blocks.__dict__, "dual_cache": 1, "guidance": 0.0}))
    assert torch.equal(guided, plain) and guided_stats.network_calls == 2 * plain_stats.network_calls


def test_block_diffusion_trains_with_flexattention_and_matches_the_dense_mask():
    """BD3-LM's training step on GPU (``train.block_attention`` auto): FlexAttention with the
    compiled BlockMask, loss and gradients those of the dense SDPA mask (bf16 rounding)."""
    from model.block_diffusion import BlockDiffusion
    from pipeline.training.attention import resolve_block_attention

    assert resolve_block_attention("auto", torch.device("cuda"), 0.0) == "flex"
    x0 = _batch()
    process = BlockDiffusion(make_schedule("linear"), VOCAB, 16, validate=False)
    t = torch.rand(BATCH, LENGTH // 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    losses, grads = {}, {}
    for kind in ("dense", "flex"):
        network = _network(kind)  # the mask's kernel is the network's, from its construction
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = process.nelbo(network, x0, t, torch.Generator(device="cuda").manual_seed(2)).sum() / x0.numel()
        loss.backward()
        losses[kind], grads[kind] = loss.detach(), network.blocks[0].attn.qkv.weight.grad.float()
    assert torch.isfinite(losses["flex"])
    torch.testing.assert_close(losses["flex"], losses["dense"], rtol=BF16_LOSS_RTOL, atol=0)
    assert torch.nn.functional.cosine_similarity(grads["flex"].flatten(), grads["dense"].flatten(), dim=0) > 0.99


@pytest.mark.parametrize("kind", ["mdlm", "block", "ar"])
def test_document_masking_trains_with_flexattention_and_matches_the_dense_mask(kind):
    """``model.document_mask`` on GPU: FlexAttention with a BlockMask per batch (``auto``'s choice),
    loss and gradients those of the dense SDPA mask (bf16 rounding), for MDLM, blocks and AR."""
    from model.autoregressive import Autoregressive
    from model.block_diffusion import BlockDiffusion

    eos = VOCAB - 1
    config = load_config(None, {"model.preset": "small", "model.document_mask": "true",
                                "train.global_batch_size": str(BATCH)})
    network_config = preset("small", VOCAB, max_seq_len=LENGTH, document_separator=eos)
    assert plan_training(config, network_config, 1, torch.device("cuda")).block_attention == "flex"
    x0 = _batch()
    x0[:, 37::53] = eos  # documents of 53 tokens, packed; tiles of 128 cut them
    t = torch.rand(BATCH, LENGTH // 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    losses, grads = {}, {}
    for attention in ("dense", "flex"):
        network = _network(attention, document_separator=eos, causal=kind == "ar")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if kind == "ar":
                loss = Autoregressive(VOCAB, validate=False).nll(network, x0).sum() / x0.numel()
            elif kind == "block":
                process = BlockDiffusion(make_schedule("linear"), VOCAB, 16, validate=False)
                loss = process.nelbo(network, x0, t, torch.Generator(device="cuda").manual_seed(2)).sum() / x0.numel()
            else:
                loss = _loss(network, x0, bf16=True)
        loss.backward()
        losses[attention], grads[attention] = loss.detach(), network.blocks[0].attn.qkv.weight.grad.float()
    assert torch.isfinite(losses["flex"])
    torch.testing.assert_close(losses["flex"], losses["dense"], rtol=BF16_LOSS_RTOL, atol=0)
    assert torch.nn.functional.cosine_similarity(grads["flex"].flatten(), grads["dense"].flatten(), dim=0) > 0.99


def test_block_diffusion_samples_with_its_kv_cache_under_bf16():
    """BD3-LM's sampler as `unmask sample` runs it on a GPU: inference mode, bf16, the KV cache of
    finished blocks; first-hitting makes one call per token, past the network's context too. The
    caller hears of every block (`unmask sample`'s progress bar counts them)."""
    from model.block_diffusion import BlockDiffusion

    network, device, samples, length = _network().eval(), torch.device("cuda"), 4, LENGTH + 64
    process = BlockDiffusion(make_schedule("linear"), VOCAB, 16, validate=False)
    plan = SamplingPlan(sampler="first-hitting", seed=0)
    blocks = []
    with torch.inference_mode(), inference_mode(network, device):
        tokens, stats = process.sample(network, plan, num_samples=samples, seq_len=length, window=LENGTH,
                                       generator=sample_generators(plan.seed, range(samples)), device=device,
                                       on_block=lambda: blocks.append(1))
    assert tokens.shape == (samples, length) and 0 <= int(tokens.min()) and int(tokens.max()) < VOCAB
    assert list(stats.row_calls) == [length] * samples and len(blocks) == length // 16



def test_autoregressive_decoding_with_its_kv_cache_gives_the_full_forward_under_bf16():
    """An autoregressive model samples as `unmask sample` runs it on a GPU (inference mode, bf16):
    one new row per call against its KV cache. Greedy tokens are the full causal forward's argmax
    wherever the full forward's top two logits are not within bf16's rounding of each other."""
    from evaluation.generation.generate import autoregressive_sample

    network, device = _network(causal=True).eval(), torch.device("cuda")
    prefix = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.inference_mode(), inference_mode(network, device):
        tokens = autoregressive_sample(network, VOCAB, prefix, LENGTH, SamplingPlan(top_p=1e-9),
                                       sample_generators(0, range(4)))
        logits = network(torch.cat([torch.full((4, 1), VOCAB, device=device), tokens[:, :-1]], dim=1)).float()
    assert torch.equal(tokens[:, :16], prefix)
    top = logits.topk(2, dim=-1).values
    clear = (top[..., 0] - top[..., 1] > 0.05)[:, 16:]
    assert bool(clear.any()) and torch.equal(logits.argmax(-1)[:, 16:][clear], tokens[:, 16:][clear])


def test_init_from_weights_loaded_on_the_host_give_the_sources_loss_on_the_device():
    """``--init-from`` loads the source into the padded training network on the host, before the
    module moves to the device: there it gives the source network's bf16 loss."""
    from dataclasses import asdict, replace

    from pipeline.training.init_from import InitRecord, InitSource, load_source

    source = _network()
    record = InitRecord(source="source", kind="export", weights="ema", file="model.safetensors", sha256="0" * 64,
                        step=None, config_sha256=None, tokenizer_sha256="0" * 64, network=asdict(source.config))
    tensors = {name: tensor.float().cpu() for name, tensor in source.state_dict().items()}
    torch.manual_seed(1)  # another initialization than the source's
    target = Transformer(replace(source.config, vocab_multiple=128))
    load_source(target, InitSource(record, tensors), target.config)
    target = target.cuda()
    x0 = _batch()
    torch.testing.assert_close(_loss(target, x0, bf16=True), _loss(source, x0, bf16=True), rtol=BF16_LOSS_RTOL, atol=0)


def test_the_distillation_loss_under_bf16_is_the_fp32_one_when_the_teachers_steps_reveal_nothing():
    """The distillation loss on the device (pipeline.training.distillation): the student's
    prediction against the teacher's two steps, with generators on the GPU. Steps of 0 reveal
    nothing, so the targets are the teacher's bf16 logits at z_t and the loss against another
    student is the fp32 one within bf16 rounding."""
    from pipeline.training.distillation import distillation_loss

    teacher, x0 = _network(), _batch()
    torch.manual_seed(3)
    student = Transformer(teacher.config).cuda()
    process = AbsorbingDiffusion(make_schedule("linear"), VOCAB, validate=False)
    t = torch.linspace(0.05, 0.95, BATCH, dtype=torch.float64)
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        generators = [torch.Generator(device="cuda").manual_seed(row) for row in range(BATCH)]
        with torch.no_grad():
            losses[dtype] = distillation_loss(student.to(dtype), teacher.to(dtype), process, x0, t, 0.0, generators,
                                              "reverse_kl").sum() / x0.numel()
    assert losses[torch.float32] > 0
    torch.testing.assert_close(losses[torch.bfloat16], losses[torch.float32], rtol=5e-2, atol=0)


def test_unmask_distill_trains_on_the_gpu_in_bf16_with_a_bf16_teacher_and_its_student_samples(
        tmp_path, tinyshakespeare_shards):
    """`unmask distill` on the device: the run's bf16, the teacher kept in it, finite divergences,
    then the student exported and sampled at the steps it was distilled for."""
    import json

    from safetensors import safe_open

    from tests.support.cli_runner import run_unmask
    from tests.support.train_helpers import run_train, write_config

    teacher = run_train(tmp_path / "teacher", tinyshakespeare_shards,
                        write_config(tmp_path / "teacher.yaml", {"logging": {"mlflow": False}})).run_dir
    config = write_config(tmp_path / "distill.yaml", {"logging": {"mlflow": False}, "eval": {"every": 2},
                                                      "distill": {"start_steps": 8, "end_steps": 2, "round_steps": 2}})
    student = run_train(tmp_path / "student", tinyshakespeare_shards, config, command=("distill", str(teacher)))
    assert "bf16" in student.output and len(student.losses()) == 4
    assert all(math.isfinite(loss) for loss in student.losses().values())
    with safe_open(str(tmp_path / "student" / "distill" / "teacher-round-1.safetensors"), "pt") as kept:
        assert kept.get_tensor(kept.keys()[0]).dtype == torch.bfloat16
    assert run_unmask(["export", str(student.run_dir)]).returncode == 0
    assert json.loads((student.run_dir / "export" / "config.json").read_text())["distilled"]["steps"] == 2
    sampled = run_unmask(["sample", str(student.run_dir), "--num", "2", "--steps", "2", "--seq-len", "32",
                          "--device", "cuda"])
    assert sampled.returncode == 0 and sampled.stdout.count("----- sample") == 2, sampled.stderr[-3000:]


# ------------------------------------------------------------------ every inference path on the GPU
GPU_PLANS = {"ancestral": SamplingPlan(steps=16), "ancestral-static": SamplingPlan(steps=16, static_shape=True),
             "first-hitting": SamplingPlan(sampler="first-hitting"),
             "first-hitting-k4": SamplingPlan(sampler="first-hitting", steps=8),
             "confidence": SamplingPlan(sampler="confidence", steps=8),
             "remdm": SamplingPlan(sampler="remdm", steps=16),
             "blocks": SamplingPlan(sampler="first-hitting", block_len=16),
             "blocks-ancestral": SamplingPlan(steps=8, block_len=16)}
TINY_EXPORT_LENGTH, TINY_VOCAB = 32, 300
TINY_BLOCK_SIZE = 8  # four blocks of the tiny context: the block mask over [x_t ; x_0] is not trivial


@pytest.fixture(scope="module")
def tiny_exports(tmp_path_factory):
    """Untrained one-layer exports (absorbing, uniform, autoregressive, a block model of
    ``TINY_BLOCK_SIZE``) and the HF directories of the first and of the block model."""
    from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
    from pipeline.interchange.export import export_to_hf
    from tests.support.export_fixtures import write_untrained_export

    root = tmp_path_factory.mktemp("gpu_exports")
    animals, places = ("cat", "dog", "fox", "owl"), ("mat", "log", "hill", "roof")
    lines = [f"the {animals[i % 4]} sat on the {places[i * 3 % 4]} at {i} past {i * 7 % 60}." for i in range(400)]
    tokenizer = train_sentencepiece(lines, root / "tok", vocab_size=TINY_VOCAB)
    paths = {name: write_untrained_export(root / name, tokenizer, root / "tok", objective=objective, config=config,
                                          max_seq_len=TINY_EXPORT_LENGTH)
             for name, objective, config in (("absorbing", "diffusion", {}), ("uniform", "diffusion",
                                                                                 {"process": "uniform"}),
                                             ("ar", "autoregressive", {}))}
    paths["hf"] = export_to_hf(paths["absorbing"], root / "hf")
    paths["block"] = write_untrained_export(root / "block", tokenizer, root / "tok",
                                            config={"block_size": TINY_BLOCK_SIZE}, max_seq_len=TINY_EXPORT_LENGTH)
    paths["block-hf"] = export_to_hf(paths["block"], root / "block-hf")
    return paths


@pytest.mark.parametrize("name", sorted(GPU_PLANS))
def test_unmask_sample_runs_every_sampler_and_blocks_on_the_gpu(tiny_exports, name):
    """``unmask sample``'s library on cuda (bf16, the attention kernel, inference mode): kept
    tokens stay, tokens are valid, and a sample does not depend on its batch."""
    from evaluation.generation.generate import generate
    from pipeline.interchange.export import load_export

    exported, plan = load_export(tiny_exports["absorbing"]), GPU_PLANS[name]
    seq_len = 2 * TINY_EXPORT_LENGTH if plan.block_len else TINY_EXPORT_LENGTH
    samples = generate(exported, plan, num=4, seq_len=seq_len, prompt="the cat", batch_size=4, device="cuda")
    prompt = exported.tokenizer.encode("the cat")
    assert all(s.tokens[:len(prompt)] == prompt and len(s.tokens) == seq_len for s in samples)
    assert all(0 <= token < exported.tokenizer.vocab_size for s in samples for token in s.tokens)
    if plan.sampler == "first-hitting" and plan.steps is None:
        assert all(s.network_calls == seq_len - len(prompt) for s in samples)   # one call per token
    alone = generate(exported, plan, num=2, seq_len=seq_len, prompt="the cat", batch_size=1, device="cuda")
    assert [s.network_calls for s in alone] == [s.network_calls for s in samples[:2]]


@pytest.mark.parametrize("name", ["uniform", "ar"])
def test_the_other_processes_sample_on_the_gpu(tiny_exports, name):
    from evaluation.generation.generate import generate
    from pipeline.interchange.export import load_export

    exported = load_export(tiny_exports[name])
    samples = generate(exported, SamplingPlan(steps=8) if name == "uniform" else SamplingPlan(), num=3, seq_len=16,
                       prompt="the dog", device="cuda")
    assert len(samples) == 3 and all(len(s.tokens) == 16 for s in samples)


@pytest.mark.parametrize("name", ["absorbing", "uniform", "ar"])
def test_lm_eval_loglikelihood_and_generate_until_run_on_the_gpu_and_agree_with_the_cpu(tiny_exports, name):
    """What lm-eval's ``loglikelihood`` and ``generate_until`` call (``evaluation.downstream.likelihoods``,
    ``sample_continuation``), on cuda under bf16: finite scores within bf16 rounding of the CPU's."""
    from evaluation.downstream.likelihoods import ScoringModel, ScoringSettings, score_continuations
    from evaluation.downstream.lm_eval_model import sample_continuation
    from pipeline.interchange.export import load_export

    exported = load_export(tiny_exports[name])
    encode = exported.tokenizer.encode
    pairs = [(encode("the cat sat on"), encode(" the mat")), (encode("the dog"), encode(" sat on the log"))]
    settings = ScoringSettings(samples=4, seed=0, batch_rows=2)
    on_gpu = score_continuations(ScoringModel.of(exported, torch.device("cuda")), pairs, settings)
    on_cpu = score_continuations(ScoringModel.of(load_export(tiny_exports[name]), torch.device("cpu")), pairs,
                                 settings)
    for gpu, cpu in zip(on_gpu, on_cpu):
        assert math.isfinite(gpu.log_likelihood)
        assert gpu.log_likelihood == pytest.approx(cpu.log_likelihood, rel=BF16_LOSS_RTOL)
    plan = SamplingPlan(sampler="first-hitting") if name == "absorbing" else SamplingPlan(steps=8)
    tokens = sample_continuation(exported, ScoringModel.of(exported, torch.device("cuda")), encode("the cat"), 6,
                                 plan=plan)
    assert len(tokens) == 6


def test_the_estimator_of_the_uniform_process_runs_on_the_gpu():
    from model.uniform import UniformDiffusion

    network = Transformer(preset("tiny", 100, max_seq_len=64, time_conditioning=True)).cuda().eval()
    generator = torch.Generator().manual_seed(3)
    blocks = wrap_blocks([torch.randint(0, 100, (150,), generator=generator).tolist() for _ in range(4)], 64,
                         eos_id=99, pad_id=0)
    with torch.no_grad(), inference_mode(network, torch.device("cuda")):
        estimate = estimate_bound(UniformDiffusion(make_schedule("linear"), 100), network, blocks,
                                  samples_per_block=4, batch_size=4, device="cuda")
    assert math.isfinite(estimate.nelbo_per_token) and estimate.standard_error > 0


def test_transformers_loads_the_hf_export_on_the_gpu_and_gives_its_logits(tiny_exports):
    transformers = pytest.importorskip("transformers")
    from pipeline.interchange.export import load_export

    model = transformers.AutoModelForMaskedLM.from_pretrained(str(tiny_exports["hf"]),
                                                              trust_remote_code=True).cuda().eval()
    network = load_export(tiny_exports["absorbing"]).network.cuda().eval()
    z = torch.randint(0, TINY_VOCAB + 1, (2, TINY_EXPORT_LENGTH), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        theirs, ours = model(input_ids=z).logits, network(z)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_transformers_runs_a_block_model_s_hf_export_on_the_gpu_with_the_cpu_s_logits(tiny_exports):
    """A block diffusion model's HF directory on cuda: the forward over [x_t ; x_0] under the dense
    block mask (SDPA's GPU kernels) gives the unmask export's block forward on the CPU."""
    transformers = pytest.importorskip("transformers")
    from pipeline.interchange.export import load_export

    model = transformers.AutoModelForMaskedLM.from_pretrained(str(tiny_exports["block-hf"]),
                                                              trust_remote_code=True).cuda().eval()
    network = load_export(tiny_exports["block"]).network.eval()
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, TINY_VOCAB, (2, TINY_EXPORT_LENGTH), generator=generator)
    z = torch.where(torch.rand(x0.shape, generator=generator) < 0.5, TINY_VOCAB, x0)
    with torch.no_grad():
        theirs = model(input_ids=z.cuda(), clean_ids=x0.cuda()).logits
        ours = network(z, None, clean=x0, block_size=TINY_BLOCK_SIZE)
    assert theirs.device.type == "cuda"
    torch.testing.assert_close(theirs.cpu(), ours, rtol=1e-4, atol=1e-4)


def test_an_export_is_checked_then_loaded_onto_the_gpu_and_a_truncated_one_is_refused(tmp_path):
    """``load_export(map_location="cuda")``, as sampling and evaluation call it on a GPU: the
    export's recorded files are checked on the host first, every digest in full: a truncated file,
    and bytes overwritten in place under the recorded modification time, are refused."""
    import os

    from common.errors import UserError
    from data_prep.tokenizer.sentencepiece_model import train_sentencepiece
    from pipeline.interchange.export import load_export
    from tests.support.export_fixtures import write_untrained_export

    tokenizer = train_sentencepiece([f"the cat {i} sat on the mat {i % 7}" for i in range(300)], tmp_path / "tok",
                                    vocab_size=300)
    export = write_untrained_export(tmp_path / "export", tokenizer, tmp_path / "tok")
    loaded = load_export(export, map_location="cuda")  # the tensors are read onto the GPU, then into the network
    assert loaded.config["step"] == 0 and not any(p.isnan().any() for p in loaded.network.parameters())
    weights = export / "model.safetensors"
    before = weights.stat()
    with weights.open("r+b") as file:
        file.seek(before.st_size // 2)
        file.write(b"Q" * 4096)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(UserError, match=rf"{weights} has other bytes than were written \(sha256 differs\)"):
        load_export(export, map_location="cuda")
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(UserError, match=rf"{weights} has 1000 bytes, \d+ were written .*the export is damaged"):
        load_export(export, map_location="cuda")


def test_a_budget_past_its_limit_is_refused_before_the_gpu_holds_anything():
    """The budget limits (``model.sampling.plan``) are checked before the tokens or the time grid
    reach the device: nothing is allocated on it, the network is never called."""
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, validate=False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with pytest.raises(PlanError, match="MAX_STEPS_PER_POSITION"):
        diffusion.sample(lambda z, t: pytest.fail("the network was called"),
                         SamplingPlan(steps=MAX_STEPS_PER_POSITION * 16 + 1), num_samples=4, seq_len=16, device="cuda")
    assert torch.cuda.memory_allocated() == before

def test_the_loader_pins_the_batches_it_joins_from_its_workers(tmp_path):
    """On a GPU the trainer asks for pinned batches; the loader pins each micro-batch after
    joining its workers' parts, and the batches are those of an unpinned loader."""
    from data_prep.shards.loader import StreamingLoader
    from tests.support.shard_fixtures import write_numbered_split

    write_numbered_split(tmp_path, [40, 40], rows_per_chunk=4)
    make = lambda **kw: StreamingLoader(tmp_path, "train", 4, rank=1, world_size=2, seed=3, shuffle_window=16, **kw)
    pinned = list(make(pin_memory=True, num_workers=2))
    assert pinned and all(batch.is_pinned() for batch in pinned)
    assert all(torch.equal(a, b) for a, b in zip(pinned, make(), strict=True))


# float32 on the GPU against BD3-LM's float32 logits on the CPU: kernels reorder the sums.
IMPORTED_LOGITS_ATOL = 1e-4


@pytest.mark.parametrize("name", ["released", "plain"])
def test_an_imported_bd3lm_model_gives_bd3lm_s_logits_on_the_gpu_and_samples(tmp_path, name):
    """`unmask import bd3lm`'s network on CUDA (adaLN at sigma = 0 in "released"): the training
    forward under FlexAttention and the dense mask, and the KV-cached sampling forward, give the
    logits BD3-LM's code computed (tests/fixtures/bd3lm); its sampler runs under bf16."""
    from model.block_attention import AttentionLayout, KVCache
    from pipeline.interchange.bd3lm_import import import_bd3lm
    from pipeline.interchange.export import load_export
    from tests.support.bd3lm_fixtures import CASES, VOCAB_SIZE, source_copy, their_outputs, write_tokenizer

    block_size, _ = CASES[name]
    exported = load_export(import_bd3lm(source_copy(tmp_path, name), write_tokenizer(tmp_path / "tok"),
                                        tmp_path / "export"))
    network, theirs = exported.network.cuda(), their_outputs(name)
    ids = theirs["input_ids"].cuda()
    length = ids.shape[1] // 2
    for kind in ("flex", "dense"):
        built = Transformer(network.config, kind).cuda()  # the same weights, the mask's kernel at construction
        built.load_state_dict(network.state_dict())
        with torch.no_grad():
            ours = built(ids[:, :length], None, clean=ids[:, length:], block_size=block_size)
        torch.testing.assert_close(ours.cpu(), theirs["logits"][..., :VOCAB_SIZE], rtol=0, atol=IMPORTED_LOGITS_ATOL)
    sample_ids, cache, outputs = theirs["sample_ids"].cuda(), KVCache(append=True), []
    with torch.no_grad():
        for start in range(0, sample_ids.shape[1], block_size):
            cache.append = start + block_size < sample_ids.shape[1]  # the last block is the noisy one
            outputs.append(network(sample_ids[:, start:start + block_size], None,
                                   layout=AttentionLayout(None, None, cache)))
    torch.testing.assert_close(torch.cat(outputs, dim=1).cpu(), theirs["sample_logits"][..., :VOCAB_SIZE], rtol=0,
                               atol=IMPORTED_LOGITS_ATOL)
    process, plan, device = exported.process(), SamplingPlan(sampler="first-hitting", seed=0), torch.device("cuda")
    with torch.inference_mode(), inference_mode(network, device):
        tokens, _ = process.sample(network, plan, num_samples=2, seq_len=3 * length, window=length,
                                   generator=sample_generators(plan.seed, range(2)), device=device)
    assert tokens.shape == (2, 3 * length) and int(tokens.max()) < VOCAB_SIZE


def test_a_sweep_trial_holds_a_gpu_on_ray_and_trains_on_it(tmp_path, tinyshakespeare_shards):
    """``unmask sweep`` with ``resources: {gpus: 1}``: Ray gives the trial's task the GPU
    (CUDA_VISIBLE_DEVICES), the ordinary loop trains there in bf16, and the bound is reported."""
    import json

    import yaml

    from tests.support.cli_runner import run_unmask
    from tests.support.train_helpers import write_config

    config = write_config(tmp_path / "micro.yaml", {"logging": {"mlflow": False}})
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"config": config.name, "data": str(tinyshakespeare_shards), "budgets": [4e9],
                                     "sizes": [{"d_model": 64}], "processes": {"mdlm": {}}, "min_steps": 4,
                                     "eval_batches": 2, "resources": {"cpus": 1, "gpus": 1}}))
    proc = run_unmask(["sweep", str(sweep), "--out", str(tmp_path / "out")], env={"PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bf16" in proc.stdout + proc.stderr   # the trial's setup line: the GPU's precision
    trial = json.loads((tmp_path / "out" / "summary.json").read_text())["trials"][0]
    assert trial["status"] == "finished" and math.isfinite(trial["nelbo_per_token"])


# ------------------------------------------------------------------ memory estimate, large and xl, FP8
def test_the_compiled_activation_estimate_bounds_the_gpu_s_peak_and_is_not_far_above_it():
    """A compiled bf16 forward and backward with every position masked (the estimate's worst
    case), gradients already allocated as in training: its peak above what was allocated before
    lies at or below pipeline.training.engine.activation_memory_bytes(compiled=True), and not far
    below it: "auto" and the memory refusal (pipeline.training.memory) rest on it. On CPU,
    tests/pipeline/training/test_memory.py holds the eager estimate to within a few percent."""
    from pipeline.training.engine import activation_memory_bytes

    network = _network().to(torch.bfloat16)
    torch._dynamo.reset()
    prepare_model(network, checkpointing=False, compile=True)
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, validate=False)
    x0, every_position_masked = _batch(), torch.full((BATCH,), 1.0, dtype=torch.float64)

    def step() -> None:
        generator = torch.Generator(device="cuda").manual_seed(2)
        diffusion.nelbo(network, x0, t=every_position_masked, generator=generator).sum().backward()

    step()
    step()  # compiled, and the gradients allocated
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    peak = torch.cuda.max_memory_allocated() - before
    estimate = activation_memory_bytes(network.config, BATCH, LENGTH, "bf16", compiled=True)
    assert 0.6 * estimate <= peak <= estimate, (peak, estimate)


def _fp8_ready() -> str | None:
    """Why FP8 cannot run here, or None."""
    import importlib.util

    if torch.cuda.get_device_capability() < (8, 9):
        return f"compute capability {torch.cuda.get_device_capability()} < 8.9"
    return None if importlib.util.find_spec("torchao") else "torchao is not installed (pip install 'unmask[fp8]')"


def test_fp8_is_planned_where_the_gpu_has_it_and_refused_in_one_line_where_not():
    from common.errors import UserError

    config = load_config(None, {"model.preset": "small", "train.global_batch_size": str(BATCH), "train.float8": "true"})
    why = _fp8_ready()
    if why is None:
        assert plan_training(config, _network().config, 1, torch.device("cuda")).float8
    else:
        with pytest.raises(UserError, match=r"^config field train.float8 = true: .*; set train.float8 false$"):
            plan_training(config, _network().config, 1, torch.device("cuda"))


FP8_STEPS = 40
# FP8's rounding (e4m3 forward, e5m2 gradients) moves the loss by a few percent at most over a
# short run; a broken cast or scale moves it by far more, or stops its descent.
FP8_LOSS_RTOL = 0.05


def _loss_curve(float8: bool) -> list[float]:
    """FP8_STEPS compiled bf16 steps of GPT-2 small on one batch (the loss falls as it memorizes)."""
    from pipeline.training.engine import build_optimizer

    network = _network().to(torch.bfloat16)
    torch._dynamo.reset()
    prepare_model(network, checkpointing=False, compile=True, float8=float8)
    optimizer = build_optimizer(network, load_config(None, {}).optim, torch.device("cuda"))
    x0, losses = _batch(), []
    for _ in range(FP8_STEPS):
        loss = _loss(network, x0, bf16=False)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_fp8_training_follows_the_bf16_loss_curve():
    """What decides FP8's default with bench/train_gpu.py's +fp8 rows (speed): the same steps in
    FP8 and bf16 from the same weights give the same loss curve within FP8's rounding."""
    why = _fp8_ready()
    if why:
        pytest.skip(why)
    bf16, fp8 = _loss_curve(False), _loss_curve(True)
    assert fp8[-1] < 0.9 * fp8[0], fp8  # it learns
    for step, (ours, theirs) in enumerate(zip(fp8, bf16)):
        assert abs(ours - theirs) <= FP8_LOSS_RTOL * theirs, (step, ours, theirs)


# ------------------------------------------------------------------ asynchronous checkpoints
def test_an_asynchronous_checkpoint_snapshots_the_device_state_and_resumes_on_the_device(tmp_path,
                                                                                          tinyshakespeare_shards):
    """checkpoint.asynchronous on the GPU: the snapshot copies the engine's device tensors to the
    host, the threads write and commit them (every file verifies), and the run resumes on the
    device from the checkpoint written while it trained on."""
    from pipeline.run_dir.checkpoint import verify_checkpoint
    from tests.support.train_helpers import run_train, write_config

    overrides = {"checkpoint": {"every": 2, "keep_last": 3, "asynchronous": True}, "train": {"max_steps": 4},
                 "logging": {"mlflow": False}}
    config = write_config(tmp_path / "c.yaml", overrides)
    run_train(tmp_path / "run", tinyshakespeare_shards, config)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step-00000004"
    assert all(verify_checkpoint(checkpoints / tag) is None for tag in ("step-00000002", "step-00000004"))
    longer = write_config(tmp_path / "longer.yaml", {**overrides, "train": {"max_steps": 6}})
    resumed = run_train(tmp_path / "run", tinyshakespeare_shards, longer)
    assert "resumed from" in resumed.output and sorted(resumed.losses()) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(loss) for loss in resumed.losses().values())


# ------------------------------------------------------------------ an adapted autoregressive model (docs/adapting.md)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_hugging_face_causal_lm_read_as_our_network_gives_transformers_logits_on_the_gpu(tmp_path, family):
    """The family layers on CUDA (SDPA's kernels, float32): transformers' own logits within 1e-4."""
    import transformers

    from pipeline.interchange.causal_lm_import import read_causal_lm
    from tests.support.causal_lm_fixtures import VOCAB_SIZE, write_causal_lm

    directory = write_causal_lm(tmp_path / family, family, seed=3)
    model = read_causal_lm(directory)
    ours = Transformer(model.network).cuda().eval()
    ours.load_state_dict({name: tensor.cuda() for name, tensor in model.tensors.items()})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).cuda().eval()
    x = torch.randint(0, VOCAB_SIZE, (4, 32), generator=torch.Generator().manual_seed(1)).cuda()
    start = torch.full((4, 1), model.start_token, device="cuda")
    with torch.no_grad():
        expected = theirs(input_ids=torch.cat([start, x], 1)).logits
        actual = ours(torch.cat([torch.full_like(start, VOCAB_SIZE), x], 1))
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4)


def test_a_shifted_block_model_trains_with_flexattention_and_matches_the_dense_mask():
    """The shift's training layout (``model.shift``) as a FlexAttention BlockMask: the dense mask's
    loss and gradients (bf16 rounding); annealed steps (dense) run under bf16 too."""
    from model.annealing import AttentionAnnealing
    from model.block_diffusion import BlockDiffusion
    from pipeline.training.objective import annealed

    x0 = _batch()
    process = BlockDiffusion(make_schedule("linear"), VOCAB, 16, validate=False)
    t = torch.rand(BATCH, LENGTH // 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    losses, grads = {}, {}
    for kind in ("dense", "flex"):
        network = _network(kind, shift=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = process.nelbo(network, x0, t, torch.Generator(device="cuda").manual_seed(2)).sum() / x0.numel()
        loss.backward()
        losses[kind], grads[kind] = loss.detach(), network.blocks[0].attn.qkv.weight.grad.float()
    torch.testing.assert_close(losses["flex"], losses["dense"], rtol=BF16_LOSS_RTOL, atol=0)
    assert torch.nn.functional.cosine_similarity(grads["flex"].flatten(), grads["dense"].flatten(), dim=0) > 0.99
    with torch.autocast("cuda", dtype=torch.bfloat16):
        half_open = process.nelbo(annealed(network, AttentionAnnealing(0.5, seed=4)), x0, t,
                                  torch.Generator(device="cuda").manual_seed(2)).sum() / x0.numel()
    assert torch.isfinite(half_open) and not torch.isclose(half_open, losses["flex"])


def test_a_shifted_block_model_samples_with_its_kv_cache_under_bf16():
    """An adapted model's block sampler on a GPU: the cache's lead token carried block to block;
    first-hitting makes one call per token."""
    from model.block_diffusion import BlockDiffusion

    network, device, samples = _network(shift=True).eval(), torch.device("cuda"), 4
    process = BlockDiffusion(make_schedule("linear"), VOCAB, 16, validate=False)
    plan = SamplingPlan(sampler="first-hitting", seed=0)
    with torch.inference_mode(), inference_mode(network, device):
        tokens, stats = process.sample(network, plan, num_samples=samples, seq_len=LENGTH, window=LENGTH,
                                       generator=sample_generators(plan.seed, range(samples)), device=device)
    assert tokens.shape == (samples, LENGTH) and int(tokens.max()) < VOCAB
    assert list(stats.row_calls) == [LENGTH] * samples


def test_an_annealed_step_runs_under_the_attention_kernel_its_plan_resolves():
    """An adapted run's annealed steps pass SDPA a boolean mask: the kernel its plan picks takes it."""
    from model.annealing import AttentionAnnealing
    from pipeline.training.attention import attention_kernel
    from pipeline.training.objective import annealed

    network = _network(shift=True)
    config = load_config(None, {"model.preset": "small", "train.global_batch_size": str(BATCH),
                                "adapt.anneal_steps": "100"})
    plan = plan_training(config, network.config, 1, torch.device("cuda"))
    diffusion = AbsorbingDiffusion(make_schedule("linear"), VOCAB, validate=False)
    x0, t = _batch(), torch.linspace(0.05, 0.95, BATCH, dtype=torch.float64)
    with attention_kernel(plan.attention), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = diffusion.nelbo(annealed(network, AttentionAnnealing(0.5, seed=1)), x0, t=t,
                               generator=torch.Generator(device="cuda").manual_seed(2)).sum() / x0.numel()
    loss.backward()
    assert torch.isfinite(loss) and plan.attention != "flash"


def test_an_adapted_gpt2_trains_compiled_under_bf16_with_the_eager_loss(tmp_path):
    """The adapted network on the path bench/train_gpu.py's +adapt-gpt2 times: bench/gpt2_source.py's
    GPT-2 (the small shape), read and adapted as --init-from does, compiled (blocks, head and loss)
    under bf16, gives the eager loss and the same gradients' direction."""
    from pipeline.training.init_from import InitFrom, adapted_source, load_source, read_source, source_network
    from tests.support.tokenizer_fixtures import byte_level_bpe

    sys.path.insert(0, str(REPO / "bench"))
    from gpt2_source import write_gpt2_source

    directory = write_gpt2_source(tmp_path / "gpt2", "small", LENGTH, byte_level_bpe(tmp_path / "tokenizer.json"))
    config = load_config(None, {"model.preset": "small", "train.global_batch_size": str(BATCH)})
    source = read_source(InitFrom(str(directory)))
    vocab = source.record.network["vocab_size"]
    network = source_network(preset("small", vocab, max_seq_len=LENGTH), source.record, config)
    source = adapted_source(source, network, config)
    objective = make_objective(config.model.spec(network), validate=False)
    x0 = torch.randint(0, vocab, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1)).cuda()
    slot = MicroBatchSlot(seed=0, step=0, rank=0, world_size=1, micro=0, micro_batches=1)
    losses, grads = {}, {}
    for compiled in (False, True):
        model = Transformer(network)
        load_source(model, source, network)
        model = model.cuda()
        prepare_model(model, checkpointing=False, compile=compiled)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = objective.loss_sum(model, x0, slot) / x0.numel()
        loss.backward()
        losses[compiled], grads[compiled] = loss.detach(), model.blocks[0].attn.qkv.weight.grad.float()
    assert network.shift and network.family.learned_positions == LENGTH + 1
    torch.testing.assert_close(losses[True], losses[False], rtol=COMPILE_LOSS_RTOL, atol=0)
    assert torch.nn.functional.cosine_similarity(grads[True].flatten(), grads[False].flatten(), dim=0) > 0.99
