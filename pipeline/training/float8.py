"""FP8 matmuls for training (``train.float8``): torchao's float8 training on the blocks' linears.

``resolve_float8`` decides the setting against the device before any work, refusing in one line
where it cannot run: on CPU, on a GPU of compute capability below 8.9 (FP8 tensor cores start
with Ada and Hopper), without torchao (the ``fp8`` extra), or with the blocks not compiled
(torchao's casts and scales are only fast fused by torch.compile). ``convert_to_float8`` swaps
each block's four projections (``FLOAT8_LAYERS``) for torchao's ``Float8Linear`` with tensorwise
scales, in place and before compilation; the weights keep their names and dtype, so
checkpoints, EMA and exports do not change. The embedding, the head and adaLN's modulation
stay in bf16 (the head's logits feed the loss; the modulation's rows are the batch, too few
for FP8 GEMM tiles). The manual: docs/performance.md#fp8.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from common.errors import UserError

__all__ = ["FLOAT8_CAPABILITY", "FLOAT8_LAYERS", "convert_to_float8", "float8_layer", "float8_refusal",
           "resolve_float8"]

# The first compute capability with FP8 tensor cores (Ada is 8.9, Hopper 9.0).
FLOAT8_CAPABILITY = (8, 9)
# The linears of a block converted, by the end of their qualified names.
FLOAT8_LAYERS = ("attn.qkv", "attn.out", "mlp.up", "mlp.down")
# torchao's scaled matmul needs both dimensions of a weight to be multiples of this.
FLOAT8_DIM_MULTIPLE = 16
# The scaling recipe: one scale per tensor (torchao's default, torchtitan's and the fastest).
FLOAT8_RECIPE = "tensorwise"
FIX = "set train.float8 false"


def float8_refusal(device: torch.device, capability: tuple[int, int] | None, installed: bool,
                   compiled: bool) -> str | None:
    """Why ``train.float8: true`` cannot run here (``capability``: the GPU's, None on CPU;
    ``installed``: torchao imports; ``compiled``: the plan compiles the blocks), or None."""
    need = f"FP8 matmuls need a CUDA GPU of compute capability {'.'.join(map(str, FLOAT8_CAPABILITY))} or higher"
    if device.type != "cuda" or capability is None:
        return f"{need} (Ada, Hopper or later), and this run is on the {device.type.upper()}; {FIX}"
    if tuple(capability) < FLOAT8_CAPABILITY:
        return f"{need} (Ada, Hopper or later), and {device} has {capability[0]}.{capability[1]}; {FIX}"
    if not installed:
        return f"FP8 training is torchao's, which is not installed: pip install 'unmask[fp8]', or {FIX}"
    if not compiled:
        return ("FP8 needs the blocks compiled (train.compile auto or true, ZeRO-1 or 2: auto is off under ZeRO-3): "
                f"torchao's casts are fast only fused by torch.compile; {FIX}")
    return None


def resolve_float8(setting: bool, device: torch.device, compiled: bool) -> bool:
    """``train.float8`` as a decision: false as given; true only where it runs (``float8_refusal``)."""
    if not setting:
        return False
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    refusal = float8_refusal(device, capability, importlib.util.find_spec("torchao") is not None, compiled)
    if refusal:
        raise UserError(f"config field train.float8 = true: {refusal}")
    return True


def float8_layer(module: nn.Module, name: str) -> bool:
    """Whether the module at qualified name ``name`` (of a ``Transformer``) is converted: one of
    a block's ``FLOAT8_LAYERS``, both of its dimensions multiples of ``FLOAT8_DIM_MULTIPLE``."""
    return (isinstance(module, nn.Linear) and name.startswith("blocks.") and name.endswith(FLOAT8_LAYERS)
            and all(size % FLOAT8_DIM_MULTIPLE == 0 for size in module.weight.shape))


def convert_to_float8(network: nn.Module) -> int:
    """Swap ``network``'s ``float8_layer`` linears for torchao's ``Float8Linear``, in place;
    how many were swapped."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    before = {name for name, module in network.named_modules() if float8_layer(module, name)}
    convert_to_float8_training(network, module_filter_fn=float8_layer,
                               config=Float8LinearConfig.from_recipe_name(FLOAT8_RECIPE))
    return len(before)
