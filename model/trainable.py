"""What a trainer optimizes when the process has parameters of its own: the network with a learned schedule.

``NetworkWithSchedule`` holds the network (parameters ``network.*``) and ``LearnedDiffusion``'s
schedule (``schedule.theta``) as one module, whose forward is the bound,
``process.nelbo(network, x0, t, generator, reconstruction)``: a trainer hands this one module
to its optimizer, its data-parallel wrapper, its EMA and its checkpoints, and every parameter
the bound reads is read inside its forward (what DeepSpeed's ZeRO-3 needs). A process without
parameters is trained as the network alone. ``split_state`` splits a trained module's tensors
(or an export's) into the network's and the schedule's. docs/model-api.md has an example.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from model.generators import Generators
from model.learned import LearnedDiffusion
from model.process import Reconstruction
from model.transformer import Transformer

__all__ = ["NETWORK_PREFIX", "SCHEDULE_PREFIX", "NetworkWithSchedule", "split_state"]

# Parameter names of a NetworkWithSchedule: its children's attribute names, then a dot.
NETWORK_PREFIX = "network."
SCHEDULE_PREFIX = "schedule."


class NetworkWithSchedule(nn.Module):
    """The network and its process's learned schedule as one module, its forward the bound.

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
