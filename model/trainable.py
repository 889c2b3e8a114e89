"""The module a trainer optimizes when the process has parameters of its own (GenMD4's theta).

``LearnedDiffusion`` trains its schedule, theta [V] in ``LearnedSchedule``, with the
network. A trainer hands ONE module to its optimizer, its data-parallel wrapper, its EMA and
its checkpoints; ``DiffusionModel`` is that module, with two children:

    network    the denoiser f(z_t, t)           parameters ``network.*``
    schedule   the process's LearnedSchedule    parameters ``schedule.theta``

and its forward is the process's bound:

    forward(x0, t, generator) = NELBO estimate per sequence, nats [B]
                              = process.nelbo(network, x0, t, generator, reconstruction)

so every parameter the bound reads, the network's and theta, is read during this module's
forward. A wrapper that materializes parameters only for the forward of the module that owns
them (DeepSpeed's ZeRO-3) must be told that theta is read here, in the forward of its parent,
(``deepspeed.zero.register_external_parameter``); outside this forward it may not exist.

A process without parameters (``AbsorbingDiffusion``, ``UniformDiffusion``) needs none of this:
its trainer optimizes the network alone. ``split_state`` splits a trained module's tensors
(or an export's, whose network tensors carry no prefix) into the network's and the schedule's.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from model.generators import Generators
from model.learned import LearnedDiffusion
from model.process import Reconstruction
from model.transformer import Transformer

__all__ = ["NETWORK_PREFIX", "SCHEDULE_PREFIX", "DiffusionModel", "split_state"]

# Parameter names of a DiffusionModel: its children's attribute names, then a dot.
NETWORK_PREFIX = "network."
SCHEDULE_PREFIX = "schedule."


class DiffusionModel(nn.Module):
    """A network and its process's learned schedule as one module; see the module docstring.

    ``process.schedule`` becomes the child ``schedule``: the process keeps reading it, so
    the optimizer's updates of theta are the process's.
    """

    def __init__(self, network: Transformer, process: LearnedDiffusion) -> None:
        super().__init__()
        if process.vocab_size != network.config.vocab_size:
            raise ValueError(f"the process has vocab_size={process.vocab_size}, the network "
                             f"{network.config.vocab_size}")
        self.network = network
        self.schedule = process.schedule
        self.process = process  # not a Module: its only parameters are the schedule's

    def forward(self, x0: Tensor, t: Tensor, generator: Generators = None, *,
                reconstruction: Reconstruction = "uniform") -> Tensor:
        """The NELBO estimate per sequence of x0 [B, L] at times t [B] (``process.nelbo``;
        a surrogate whose gradient reaches theta), float64 [B]."""
        return self.process.nelbo(self.network, x0, t, generator, reconstruction=reconstruction)


def split_state(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(the network's tensors, the schedule's tensors), each by its name inside its own module:
    ``schedule.*`` names are the schedule's, ``network.*`` and unprefixed names the network's."""
    network, schedule = {}, {}
    for name, tensor in state.items():
        if name.startswith(SCHEDULE_PREFIX):
            schedule[name.removeprefix(SCHEDULE_PREFIX)] = tensor
        else:
            network[name.removeprefix(NETWORK_PREFIX)] = tensor
    return network, schedule
