"""Correctness on a CUDA GPU (marker ``gpu``; skipped, with the reason, on a machine without one).

What only a GPU exercises: bf16 autocast against float32 on the same batch, the flash
attention kernel, NCCL, ``train.compile`` with Triton kernels, and the evaluation bound
under bf16 against float32 on the same weights; and the defaults of issue 24: compile "auto"
(blocks, head and loss, a bounded number of graphs), the attention kernels SDPA offers here
(cuDNN, flash) and "auto"'s choice, the padded vocabulary under bf16, the host syncs of a
training micro-step, sampling under bf16. ``make gpu-check`` runs these and the GPU benchmark in one command;
``bench/gpu_check.sh`` runs them on a lent device (README: Performance).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import warnings

from evaluation.estimator import estimate_bound, wrap_blocks
from evaluation.inference import inference_mode
from model.diffusion import MaskedDiffusion
from model.sampling import SamplingPlan, sample_generators
from model.schedules import make_schedule
from model.spec import ModelSpec
from model.transformer import Transformer, preset
from pipeline.attention import AUTO_ORDER, attention_kernel, kernel_runs, resolve_attention
from pipeline.config import load_config
from pipeline.ema import EMA
from pipeline.engine import plan_training, prepare_model
from pipeline.objective import MicroBatchSlot, make_objective
from tests.cli_runner import cli_env
from tests.paths import REPO

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")]

VOCAB, LENGTH, BATCH = 50257, 256, 8
# bf16 keeps 8 bits of mantissa: a loss of ~10 nats agrees with float32 to a few 1e-3.
BF16_LOSS_RTOL = 1e-2
COMPILE_LOSS_RTOL = 1e-3
# |bf16 - fp32| of the evaluation bound, in units of its standard error.
EVAL_Z_LIMIT = 3.0


def _network(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(preset("small", VOCAB, max_seq_len=LENGTH, **overrides)).cuda()


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1)).cuda()


def _loss(network: torch.nn.Module, x0: torch.Tensor, *, bf16: bool) -> torch.Tensor:
    diffusion = MaskedDiffusion(make_schedule("linear"), VOCAB, validate=False)
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
    """What `unmask train` does alone: DeepSpeed joins a world of one on NCCL."""
    script = ("import torch, torch.distributed as d; from pipeline.distributed import init_distributed;"
              "g = init_distributed(); t = torch.ones(1, device=g.device); d.all_reduce(t);"
              "print(g.backend, d.get_backend(), int(t.item()))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["nccl", "nccl", "1"]


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
    # Other mask counts (other times) reuse the graphs compiled so far (the blocks', the head
    # and loss's; the t = 0 reconstruction's smaller batch may have added the blocks' dynamic one).
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 2 <= graphs <= 3
    diffusion = MaskedDiffusion(make_schedule("linear"), VOCAB, validate=False)
    for step in range(6):
        t = torch.full((BATCH,), (step + 0.5) / 6, dtype=torch.float64)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            diffusion.nelbo(compiled, x0, t, torch.Generator("cuda").manual_seed(step),
                            reconstruction="uniform").sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


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
    the masked count and the host's times; the device never drains in the middle of a step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Syncs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.matmuls, self.syncs = 0, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = func(*args, **(kwargs or {}))
            if any("synchronizing" in str(w.message) for w in caught):
                self.syncs.append((func._schema.name, self.matmuls))
            self.matmuls += func._schema.name in ("aten::mm", "aten::addmm", "aten::bmm")
            return out

    network = _network()
    objective = make_objective(ModelSpec(network=network.config), validate=False)
    ema = EMA(network, 0.99)
    slot = MicroBatchSlot(seed=0, step=3, rank=0, world_size=1, micro=0, micro_batches=1)
    x0 = _batch()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with Syncs() as syncs, torch.autocast("cuda", dtype=torch.bfloat16):
            loss_sum = objective.loss_sum(network, x0, slot)
            (loss_sum / x0.numel()).backward()
            ema.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert syncs.matmuls > 0 and syncs.syncs, "sync debug mode reported nothing: is it on?"
    assert all(matmuls == 0 for _, matmuls in syncs.syncs), syncs.syncs


def test_the_evaluation_bound_under_bf16_is_the_fp32_bound_within_its_standard_error():
    network = _network().eval()
    generator = torch.Generator().manual_seed(3)
    documents = [torch.randint(0, VOCAB, (300,), generator=generator).tolist() for _ in range(16)]
    blocks = wrap_blocks(documents, LENGTH, eos_id=VOCAB - 1, pad_id=0)
    diffusion = MaskedDiffusion(make_schedule("linear"), VOCAB, validate=False)
    estimates = {}
    for bf16 in (False, True):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            estimates[bf16] = estimate_bound(diffusion, network, blocks, samples_per_block=8, seed=0,
                                             batch_size=8, device="cuda")
    fp32, bf16 = estimates[False], estimates[True]
    assert abs(bf16.nelbo_per_token - fp32.nelbo_per_token) < EVAL_Z_LIMIT * fp32.standard_error


def test_first_hitting_sampling_runs_under_bf16_one_call_per_token():
    """As ``unmask sample`` runs on a GPU (``evaluation.generation``): inference mode, bf16
    autocast and the attention kernel of evaluation (compiled sampling is tested on CPU; a
    compile here would cost the GPU check's time limit)."""
    network, device, samples, length = _network().eval(), torch.device("cuda"), 4, 64
    diffusion = MaskedDiffusion(make_schedule("linear"), VOCAB, validate=False)
    plan = SamplingPlan(sampler="first-hitting", seed=0)
    with torch.inference_mode(), inference_mode(network, device):
        tokens, stats = diffusion.sample(network, plan, num_samples=samples, seq_len=length, window=LENGTH,
                                         generator=sample_generators(plan.seed, range(samples)), device=device)
    assert tokens.shape == (samples, length) and 0 <= int(tokens.min()) and int(tokens.max()) < VOCAB
    assert list(stats.row_calls) == [length] * samples  # exact first-hitting: one call per token


def test_the_loader_pins_the_batches_it_joins_from_its_workers(tmp_path):
    """On a GPU the trainer asks for pinned batches; the loader pins each micro-batch after
    joining its workers' parts (issue 32), and the batches are those of an unpinned loader."""
    from data_prep.loader import StreamingLoader
    from tests.shard_fixtures import write_numbered_split

    write_numbered_split(tmp_path, [40, 40], rows_per_chunk=4)
    make = lambda **kw: StreamingLoader(tmp_path, "train", 4, rank=1, world_size=2, seed=3, shuffle_window=16, **kw)
    pinned = list(make(pin_memory=True, num_workers=2))
    assert pinned and all(batch.is_pinned() for batch in pinned)
    assert all(torch.equal(a, b) for a, b in zip(pinned, make(), strict=True))
