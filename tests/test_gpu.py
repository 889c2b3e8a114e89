"""Correctness on a CUDA GPU (marker ``gpu``; skipped, with the reason, on a machine without one).

What only a GPU exercises: bf16 autocast against float32 on the same batch, the flash
attention kernel, NCCL, ``train.compile`` with Triton kernels, and the evaluation bound
under bf16 against float32 on the same weights. ``make gpu-check`` runs these and the GPU
benchmark in one command.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from evaluation.estimator import estimate_bound, wrap_blocks
from model.diffusion import MaskedDiffusion
from model.schedules import make_schedule
from model.transformer import Transformer, preset
from pipeline.engine import prepare_model
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


def test_compiled_blocks_give_the_eager_loss_and_gradients():
    x0 = _batch()
    eager, compiled = _network(), _network()
    prepare_model(compiled, checkpointing=False, compile=True)
    losses, grads = [], []
    for network in (eager, compiled):
        loss = _loss(network, x0, bf16=True)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten().float() for p in network.parameters()]))
    torch.testing.assert_close(losses[1], losses[0], rtol=COMPILE_LOSS_RTOL, atol=0)
    cosine = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert cosine > 0.999


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
