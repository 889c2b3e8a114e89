"""How evaluation, sampling and lm-eval run the network on a device: in bf16 with the fastest
attention kernel on a GPU, and compiled when the work repays the compile.

``inference_mode`` is the precision and kernel: on a GPU bf16 autocast (float32 norms and
log-softmax; the callers sum in float64) with the kernel ``pipeline.attention`` finds fastest
there; on CPU float32 with SDPA's own choice. ``should_compile`` decides a ``--compile``
setting (``COMPILE_SETTINGS``: ``unmask eval --compile``, ``unmask sample --compile``, a
``SamplingPlan``'s ``compile``) from the tokens a run passes through the network.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from model.sampling import COMPILE_SETTINGS
from model.transformer import Transformer
from pipeline.attention import attention_kernel, resolve_attention

__all__ = ["COMPILE_MIN_TOKENS", "COMPILE_SETTINGS", "inference_mode", "should_compile"]

# "auto" compiles the network on a GPU when a rank passes at least this many tokens through it
# (evaluation: blocks x length x time samples; sampling: rows x length x calls): compiling GPT-2
# medium takes about half a minute, which the fused kernels pay back only over a couple of
# minutes of work (~30M tokens at 2e5/s).
COMPILE_MIN_TOKENS = 32_000_000


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
    with torch.autocast("cuda", dtype=torch.bfloat16), attention_kernel(kernel):
        yield
