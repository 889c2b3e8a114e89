"""How evaluation, sampling and lm-eval run the network on a device: in bf16 with the fastest
attention kernel on a GPU, and compiled when the work repays the compile.

``inference_mode`` is the precision and kernel: on a GPU bf16 autocast (float32 norms and
log-softmax; the callers sum in float64) with the kernel ``pipeline.training.attention`` finds
fastest there; on CPU float32 with SDPA's own choice. ``should_compile`` decides a ``--compile``
setting (``COMPILE_SETTINGS``: ``unmask eval --compile``, ``unmask sample --compile``, a
``SamplingPlan``'s ``compile``) from the tokens a run passes through the network.
``resolve_device`` is every command's ``--device``: the GPU when there is one, else the CPU.
See docs/performance.md.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from common.errors import UserError
from model.sampling import COMPILE_SETTINGS
from model.transformer import Transformer
from pipeline.training.attention import attention_kernel, resolve_attention

__all__ = ["BLOCKS_UNCOMPILED", "COMPILE_MIN_TOKENS", "COMPILE_SETTINGS", "DEVICE_HELP", "default_device",
           "inference_mode", "resolve_device", "should_compile"]

# Every command's --device help: what resolve_device does with no --device.
DEVICE_HELP = "cpu, cuda, cuda:1 (default: cuda when there is one, else cpu)"
# "auto" compiles the network on a GPU when a rank passes at least this many tokens through it
# (evaluation: blocks x length x time samples; sampling: rows x length x calls): compiling GPT-2
# medium takes about half a minute, which the fused kernels pay back only over a couple of
# minutes of work (~30M tokens at 2e5/s).
COMPILE_MIN_TOKENS = 32_000_000
# Why a block diffusion model is never compiled, which `--compile on` is refused with: its
# sampler runs the KV cache between the network's calls, and its compiled blocks with
# FlexAttention's mask have not run on a GPU yet.
BLOCKS_UNCOMPILED = ("a block diffusion model is sampled and scored uncompiled (its sampler runs the KV cache "
                     "between the network's calls, and its compiled FlexAttention blocks have not run on a GPU yet)")


def default_device() -> torch.device:
    """Where a command runs when ``--device`` is not given: the (current) GPU when there is one."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(name: str | None = None) -> torch.device:
    """The torch device ``name`` (cpu, cuda, cuda:1), or ``default_device()`` for None; a
    UserError naming ``--device`` when it is not one or is not on this machine."""
    if name is None:
        return default_device()
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise UserError(f"--device {name!r} is not a torch device ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine")
    return device


def should_compile(setting: str, device: torch.device, tokens: int) -> bool:
    """A compile ``setting``: on, off, or auto: on a GPU when ``tokens`` reach ``COMPILE_MIN_TOKENS``
    (on CPU inductor's C++ compile outlasts the runs it would speed up)."""
    if setting not in COMPILE_SETTINGS:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_SETTINGS)}, got {setting!r}")
    if setting != "auto":
        return setting == "on"
    return device.type == "cuda" and tokens >= COMPILE_MIN_TOKENS


@contextlib.contextmanager
def inference_mode(network: Transformer, device: torch.device) -> Iterator[None]:
    """Run ``network`` as evaluation does on ``device`` (module docstring)."""
    if device.type != "cuda":
        yield
        return
    # Forward only: inference never runs a backward, and callers are inside no_grad/inference_mode.
    kernel = resolve_attention("auto", device, torch.bfloat16, network.config.head_dim, causal=network.config.causal,
                               backward=False)
    network.block_attention = "flex"  # a block diffusion's bound: FlexAttention's block mask on a GPU
    with torch.autocast("cuda", dtype=torch.bfloat16), attention_kernel(kernel):
        yield
