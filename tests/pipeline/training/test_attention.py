"""The attention kernel (``pipeline.training.attention``): "auto" picks one that runs here, a
named one that does not is refused, the probe answers alike in every grad mode, the chosen
kernel is the only one SDPA may use, and the flash and math kernels give the same loss."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from common.errors import UserError
from model.absorbing import AbsorbingDiffusion
from model.schedules import make_schedule
from pipeline.config import load_config
from pipeline.training.attention import attention_kernel, available_kernels, resolve_attention
from tests.support.small_networks import VOCAB, small_network, token_batch
from tests.support.small_networks import loss_and_ordered_grads as _nelbo_and_grads

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTH = 12
_net = partial(small_network, LENGTH)
_batch = partial(token_batch, 4, LENGTH)


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
    # evaluation, sampling and lm-eval probe inside no_grad/inference_mode: the probe must work there.
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
