"""The process group: who we are (rank, world size, device) whatever launched us.

``deepspeed``, ``torchrun`` and Ray Train all describe the process through the same
environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); a plain
``unmask train`` sets none and becomes a world of one, rendezvousing on 127.0.0.1. The
training loop only ever sees a ``Distributed``, never a launcher. The manual: docs/cluster.md.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Distributed", "init_distributed", "free_port"]

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Distributed:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    # A gloo group over the same ranks for host values (flags, logged sums) under NCCL: NCCL
    # moves only device tensors, and reading one back would wait for the device's queue, a
    # host sync the training loop would pay at every step boundary. None: the default group.
    host_group: Any = None
    # The launcher variables init_distributed set for a process no launcher started; shutdown
    # removes them, so a Ray head or a child started later by this process does not inherit a
    # rendezvous port nobody listens on (or one still held).
    variables_set: tuple[str, ...] = ()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Sum float64 values over all ranks (one collective)."""
        if self.world_size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self._host_device)
        dist.all_reduce(tensor, group=self.host_group)
        return tensor.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when any rank passes True (no device sync under NCCL: ``host_group``)."""
        if self.world_size == 1:
            return flag
        tensor = torch.tensor([int(flag)], device=self._host_device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.host_group)
        return bool(tensor.item())

    def broadcast(self, obj: object) -> object:
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.host_group, device=self._host_device)
        return box[0]

    def shutdown(self) -> None:
        """Leave the process group together: a rank that exits while others still use it
        can abort in gloo's destructor ("terminate called without an active exception")."""
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        self.unset_variables()

    def unset_variables(self) -> None:
        """Remove the launcher variables this process set for itself (``variables_set``: the
        engine reads them while it lives); a launcher's stay. Alone, without leaving the group:
        for a failed run, or a group made before (which a world of one keeps)."""
        for name in self.variables_set:
            os.environ.pop(name, None)

    @property
    def _host_device(self) -> torch.device:
        # NCCL moves only CUDA tensors; gloo (the default group on CPU, or host_group) only CPU ones.
        return self.device if self.backend == "nccl" and self.host_group is None else torch.device("cpu")


def init_distributed(timeout_minutes: float = 30.0, *, deepspeed_backend: bool = True) -> Distributed:
    """Join (or, alone, create) the default process group, through DeepSpeed for training
    (``deepspeed_backend``) or torch alone (evaluation, which needs no DeepSpeed).

    Backend: NCCL with CUDA, gloo on CPU. A process that no launcher started gets
    RANK=0, WORLD_SIZE=1 and a free loopback port.
    """
    import datetime

    lone = {} if "RANK" in os.environ else {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                                              "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(free_port())}
    os.environ.update(lone)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # DeepSpeed 0.19 calls all_gather_into_tensor and reduce_scatter_tensor, deprecated in torch 2.13, on every ZeRO-3
    # gather: one warning per call would bury the training log.
    warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).* is deprecated",
                            category=FutureWarning)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    # DeepSpeed JIT-builds its CPU comm op (about a minute) into torch's extension cache; one
    # cache per environment keeps two checkouts from rebuilding each other's. Set even when a
    # launcher (Ray Train) already made the process group: the engine still builds the op.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    if dist.is_initialized():
        pass
    elif deepspeed_backend:
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False, timeout=timeout)
    elif world_size > 1:
        dist.init_process_group(backend=backend, timeout=timeout)
    # Every rank creates it, in the same order (new_group is collective).
    host_group = dist.new_group(backend="gloo") if backend == "nccl" and world_size > 1 else None
    return Distributed(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                       backend=backend, host_group=host_group, variables_set=tuple(lone))
