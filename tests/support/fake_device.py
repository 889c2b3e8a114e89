"""A pretend accelerator on CPU, and the device rules a GPU enforces, so a CPU test sees where host
and device tensors meet (a host tensor indexed by a device mask, ``t[rows]``, runs on a CPU and
crashes on a GPU). ``OnDevice`` wraps a denoiser as a network on that device.

The pretend device is ``DEVICE`` (torch's ``meta`` device type: a CPU-only torch refuses to make
anything that says ``cuda``, while ``meta`` passes every check before dispatch and runs no kernel
of its own). ``on_fake_device()`` is a ``TorchDispatchMode``: inside it, ``torch.zeros(...,
device=DEVICE)``, ``x.to(DEVICE)`` and ``module.to(DEVICE)`` make ``DeviceTensor``s (CPU data,
``device`` meta), ``.cpu()`` brings them back, and every other operation runs on the CPU data
after the checks a CUDA kernel makes, raising the same kind of ``RuntimeError``:

- all tensor operands on one device, except 0-dim host tensors (CUDA takes them as scalars);
- an index into a device tensor may be on the host; an index into a host tensor may not be on
  the device ("indices should be either on cpu or on the same device as the indexed tensor");
  the values written into a device tensor must be on the device;
- random draws on the device take no host generator (nor the reverse);
- copies (``.to``, ``copy_``) cross devices freely; ``.numpy()`` of a device tensor is refused.

It counts the host reads of device values (``item()``, ``bool()``, ``tolist()``, ``.cpu()``: the
syncs of a GPU) in ``syncs``. Only the operations this project's inference uses are modelled, and
what is not (a tensor torch made with the modes off) raises rather than passes: a wrong verdict
is a bug of this file, not of the code under test. Code that branches on ``device.type ==
"cuda"`` (bf16 autocast, the attention probe) takes its CPU branch here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from model.denoiser import Denoiser

__all__ = ["DEVICE", "DeviceTensor", "FakeDevice", "OnDevice", "on_fake_device"]

DEVICE = torch.device("meta")
_HOST = torch.device("cpu")
_aten = torch.ops.aten
# Operations whose tensor operands after the first are indices (may be on the host for a device tensor).
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}
# Operations that move data between devices.
_COPIES = {_aten._to_copy.default, _aten.copy_.default}
_TO_HOST_READS = {_aten._local_scalar_dense.default}


class UnmodelledOperation(AssertionError):
    """An operation whose device semantics this file does not model: the test that reached it
    fails, rather than passing on a guess about what CUDA would do."""


class DeviceTensor(torch.Tensor):
    """A tensor on the pretend device: ``device`` cuda:0, its data a CPU tensor ``elem``."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> "DeviceTensor":
        # A wrapper is never an inference tensor (torch refuses one without storage); its data may be.
        with torch.inference_mode(False):
            out = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                      storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                      device=DEVICE, requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    def __repr__(self) -> str:  # the data's repr, on the pretend device
        return f"DeviceTensor({self.elem!r})"

    # torch turns a list index into a tensor on the indexed tensor's device with the modes off,
    # which would make a real (empty) meta tensor here: the list goes in as a host tensor instead,
    # which a device tensor takes as an index.
    def __getitem__(self, index: Any) -> Any:
        return super().__getitem__(_lists_on_host(index))

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(_lists_on_host(index), value)

    def tolist(self) -> Any:  # a host read of device values, as item() is
        FakeDevice.count_sync()
        return self.elem.tolist()

    def numpy(self, *, force: bool = False) -> Any:
        raise TypeError("can't convert a device tensor to numpy: use Tensor.cpu() first")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a DeviceTensor outside on_fake_device()")


def _lists_on_host(index: Any) -> Any:
    if isinstance(index, list):
        return torch.tensor(index, dtype=torch.long)
    if isinstance(index, tuple):
        return tuple(_lists_on_host(part) for part in index)
    return index


def _rewrap(value: Any, wrappers: dict[int, DeviceTensor]) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    wrapper = wrappers.get(id(value))
    return wrapper if wrapper is not None else DeviceTensor(value)


def _device_of(value: Any) -> torch.device | None:
    if isinstance(value, DeviceTensor):
        return DEVICE
    if isinstance(value, torch.Tensor):
        return value.device
    return None


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DeviceTensor) and value.dim() == 0


class FakeDevice(TorchDispatchMode):
    """The mode of ``on_fake_device`` (module docstring); ``syncs`` counts host reads of device values."""

    active: list["FakeDevice"] = []

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def __enter__(self) -> "FakeDevice":
        FakeDevice.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        FakeDevice.active.remove(self)
        return super().__exit__(*exc)

    @staticmethod
    def count_sync() -> None:
        if FakeDevice.active:
            FakeDevice.active[-1].syncs += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        wanted = kwargs.get("device")
        wanted = torch.device(wanted) if wanted is not None else None
        target = self._check(func, args, kwargs, wanted)
        if func in _TO_HOST_READS and isinstance(args[0], DeviceTensor) or (
                func == _aten._to_copy.default and isinstance(args[0], DeviceTensor) and target == _HOST):
            self.syncs += 1
        if func.overloadpacket == _aten.to and target == DEVICE and wanted is None and not isinstance(
                args[0], DeviceTensor):
            raise UnmodelledOperation(f"{func}: a host tensor moved by an overload this file does not model")
        if wanted is not None and wanted.type == DEVICE.type:
            kwargs["device"] = _HOST
        wrappers = {id(x.elem): x for x in tree_flatten((args, kwargs))[0] if isinstance(x, DeviceTensor)}
        plain_args, plain_kwargs = tree_map(lambda x: x.elem if isinstance(x, DeviceTensor) else x, (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        if target == _HOST:
            return out
        # In-place results come back as the wrapper they were called on.
        return tree_map(lambda x: _rewrap(x, wrappers), out)

    def _check(self, func, args, kwargs, wanted: torch.device | None) -> torch.device:
        """The device of ``func``'s result, after CUDA's checks of its operands."""
        operands = [x for x in tree_flatten((args, {k: v for k, v in kwargs.items() if k != "generator"}))[0]
                    if isinstance(x, torch.Tensor)]
        if any(x.device == DEVICE and not isinstance(x, DeviceTensor) for x in operands):
            # torch.tensor(data, device=...) and list indices build their tensor with the modes off
            raise UnmodelledOperation(f"{func}: a {DEVICE.type} tensor made outside the pretend device's mode")
        generator = kwargs.get("generator")
        if func in _COPIES or func.overloadpacket == _aten.to:
            if func == _aten.copy_.default:
                return _device_of(args[0])
            if func == _aten.to.other:   # x.to(y): y's device
                return _device_of(args[1])
            return wanted if wanted is not None else _device_of(args[0])
        if func in _INDEXING and operands:
            base, rest = operands[0], operands[1:]
            devices = {_device_of(base)} | {_device_of(x) for x in rest if not _is_scalar(x)}
            if _device_of(base) == _HOST and DEVICE in devices:
                raise RuntimeError(f"{func}: indices should be either on cpu or on the same device as the indexed "
                                   f"tensor (cpu)")
            # a device tensor takes host indices; its values (index_put) must be on its device
            if func != _aten.index.Tensor and _device_of(base) == DEVICE:
                values = args[2] if len(args) > 2 else kwargs.get("values")
                if isinstance(values, torch.Tensor) and not _is_scalar(values) and _device_of(values) != DEVICE:
                    raise RuntimeError(f"{func}: values on {_device_of(values)}, the indexed tensor on {DEVICE}")
            return _device_of(base)
        devices = {_device_of(x) for x in operands if not _is_scalar(x)}
        if wanted is not None:
            devices.add(DEVICE if wanted.type == DEVICE.type else _HOST)
        if len(devices) > 1:
            raise RuntimeError(f"{func}: Expected all tensors to be on the same device, but found at least two "
                               f"devices, {DEVICE} and cpu!")
        target = devices.pop() if devices else (DEVICE if any(isinstance(x, DeviceTensor) for x in operands) else _HOST)
        if isinstance(generator, torch.Generator) and generator.device.type != target.type:
            raise RuntimeError(f"{func}: Expected a '{target.type}' device type for generator but found "
                               f"'{generator.device.type}'")
        return target


@contextlib.contextmanager
def on_fake_device() -> Iterator[FakeDevice]:
    """A block in which ``cuda`` is the pretend device of ``FakeDevice`` (module docstring)."""
    with FakeDevice() as mode:
        yield mode


class OnDevice(Denoiser):
    """``inner`` run as a network on the device: it takes device tensors only (z_t and t) and
    answers on the device."""

    def __init__(self, inner: Denoiser) -> None:
        self.inner = inner

    def logits(self, z_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        for name, value in (("z_t", z_t), ("t", t)):
            assert isinstance(value, DeviceTensor), f"the network got {name} on {value.device}, not on the device"
        return self.inner.logits(z_t.cpu(), t.cpu()).to(DEVICE)

    @property
    def time_independent(self) -> bool:
        return self.inner.time_independent
