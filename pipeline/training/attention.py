"""The attention kernel: which of torch SDPA's backends runs the network's attention.

``train.attention`` names one (``cudnn``, ``flash``, ``efficient``, ``math``) or ``auto``.
Rather than restate SDPA's rules, each candidate is tried once on a tiny input of the
network's head size and dtype (``kernel_runs``, forward and backward for training, forward
only for inference, in its own grad mode whatever the caller's), so the answer is the
dispatcher's own; ``auto`` takes the first that runs in ``AUTO_ORDER``, and a named kernel
that does not run is refused in one line naming those that do. Block diffusion's mask is
probed too, and ``train.block_attention`` picks FlexAttention or the dense mask
(``resolve_block_attention``). ``attention_kernel`` restricts SDPA to the chosen backend for
a whole run, compiled graphs included. The manual: docs/performance.md.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common.errors import UserError
from model.block_attention import BlockAttention, dense_block_mask

__all__ = ["AUTO_ORDER", "KERNELS", "attention_kernel", "available_kernels", "kernel_runs", "resolve_attention",
           "resolve_block_attention"]

KERNELS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# Fastest first, per device type (module docstring). CPU has no cuDNN or memory-efficient kernel.
AUTO_ORDER = {"cuda": ("cudnn", "flash", "efficient", "math"), "cpu": ("flash", "math")}
# The probe's shape: [batch, heads, length, head_dim] with the network's head_dim.
_PROBE_HEADS, _PROBE_LENGTH = 2, 16
# The masked probe's blocks: a dense block-diffusion mask over [z ; x] of 2 x 8 rows.
_PROBE_BLOCK = 4


def kernel_runs(name: str, device: torch.device, dtype: torch.dtype, head_dim: int, *, causal: bool = False,
                dropout: float = 0.0, masked: bool = False, backward: bool = True) -> bool:
    """Whether SDPA's ``name`` backend runs attention of ``head_dim`` at ``dtype`` on
    ``device``, forward and (``backward``) backward: a tiny probe whose refusal is SDPA's own,
    in its own grad mode whatever the caller's (module docstring). ``masked``: with a boolean
    attention mask (block diffusion's dense mask; flash refuses one on GPU)."""
    shape = (1, _PROBE_HEADS, _PROBE_LENGTH, head_dim)
    # inference_mode(False) first: inside the caller's inference_mode, tensors made under
    # enable_grad alone would still be inference tensors that cannot record a graph.
    with torch.inference_mode(False), torch.set_grad_enabled(backward):
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=backward) for _ in range(3))
        mask = dense_block_mask(_PROBE_LENGTH // 2, _PROBE_BLOCK, device) if masked else None
        try:
            # SDPA warns why it refuses a kernel; the refusal itself is the answer here.
            with warnings.catch_warnings(), sdpa_kernel([KERNELS[name]]):
                warnings.simplefilter("ignore")
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout)
                if backward:
                    out.sum().backward()
        except RuntimeError:  # "No available kernel", or a kernel that fails on this device
            return False
    return True


def available_kernels(device: torch.device, dtype: torch.dtype, head_dim: int, *, causal: bool = False,
                      dropout: float = 0.0, masked: bool = False, backward: bool = True) -> list[str]:
    """The kernels of ``KERNELS`` that run here (``kernel_runs``), in ``KERNELS``' order."""
    return [name for name in KERNELS
            if kernel_runs(name, device, dtype, head_dim, causal=causal, dropout=dropout, masked=masked,
                           backward=backward)]


def resolve_attention(setting: str, device: torch.device, dtype: torch.dtype, head_dim: int, *,
                      causal: bool = False, dropout: float = 0.0, masked: bool = False,
                      backward: bool = True) -> str:
    """The kernel ``train.attention = setting`` stands for here: ``auto``'s choice, or the one
    named once it is known to run (``backward``: for training too, else for inference only;
    ``masked``: it must take a boolean mask, block diffusion's dense mask); a UserError naming
    the field otherwise."""
    options = dict(causal=causal, dropout=dropout, masked=masked, backward=backward)
    if setting == "auto":
        for name in AUTO_ORDER.get(device.type, ("math",)):
            if kernel_runs(name, device, dtype, head_dim, **options):
                return name
        raise UserError(f"config field train.attention = auto: no attention kernel runs on {device} at {dtype}")
    if setting not in KERNELS:
        raise UserError(f"config field train.attention = {setting!r}: choose one of {['auto', *KERNELS]}")
    if not kernel_runs(setting, device, dtype, head_dim, **options):
        runs = available_kernels(device, dtype, head_dim, **options)
        raise UserError(f"config field train.attention = {setting}: this kernel does not run on {_describe(device)} "
                        f"at {str(dtype).removeprefix('torch.')} with head size {head_dim}"
                        f"{' and dropout' if dropout else ''}; choose auto or one that runs here: {', '.join(runs)}")
    return setting


def resolve_block_attention(setting: str, device: torch.device, dropout: float) -> BlockAttention:
    """The mask ``train.block_attention = setting`` stands for: ``auto`` is FlexAttention on GPU
    without dropout (it has none), the dense SDPA mask otherwise; ``flex`` where it cannot train
    (CPU: no backward there; dropout) is refused in one line."""
    flex_trains = device.type == "cuda" and not dropout
    if setting == "auto":
        return "flex" if flex_trains else "dense"
    if setting == "flex" and not flex_trains:
        why = "attention dropout (model.dropout > 0)" if dropout else f"training on {device.type.upper()}"
        raise UserError(f"config field train.block_attention = flex: FlexAttention does not support {why}; "
                        "choose auto or dense")
    return setting


@contextlib.contextmanager
def attention_kernel(name: str) -> Iterator[None]:
    """SDPA restricted to the backend ``name`` (a ``KERNELS`` key) inside the block."""
    with sdpa_kernel([KERNELS[name]]):
        yield


def _describe(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type.upper()
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
