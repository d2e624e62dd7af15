"""Every device-specific call epmoe makes, in one place.

Nothing else in the package names ``torch.cuda`` or ``torch.npu``: code asks this module which
device type it is on, how to synchronise it, which collective backend fits it, and for streams,
events and capabilities. Adding a platform means adding one branch here (and, for grouped matmul,
one backend in :mod:`epmoe.gmm`).

    model code / engine / ops
              |
              v
      epmoe.platform  --  "cpu" | "cuda" | "npu" | "xpu" | "mps"
              |
              v
      torch.cuda / torch.npu (torch_npu) / torch.xpu / torch.mps
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "comm_backend",
    "current_device",
    "device_capability",
    "device_module",
    "device_type",
    "host_to_device",
    "is_available",
    "new_stream",
    "peak_memory",
    "reset_peak_memory",
    "stream",
    "synchronize",
    "torch_npu",
    "wait_stream",
]

_ACCELERATORS = ("npu", "cuda", "xpu", "mps")
_COMM_BACKENDS = {"cuda": "nccl", "npu": "hccl", "xpu": "xccl", "cpu": "gloo", "mps": "gloo"}


@functools.cache
def torch_npu() -> ModuleType | None:
    """The ``torch_npu`` module if it imports, else ``None`` (imported once; registers ``torch.npu``)."""
    try:
        return importlib.import_module("torch_npu")
    except Exception:  # noqa: BLE001 - a broken vendor install must not break epmoe's import
        return None


def device_module(device_type_: str) -> Any | None:
    """``torch.cuda`` / ``torch.npu`` / ``torch.xpu`` / ``torch.mps`` for a device type, else ``None``."""
    if device_type_ == "npu":
        torch_npu()
    return getattr(torch, device_type_, None) if device_type_ in _ACCELERATORS else None


def is_available(device_type_: str) -> bool:
    """Whether at least one device of ``device_type_`` can be used in this process."""
    if device_type_ == "cpu":
        return True
    module = device_module(device_type_)
    if module is None or not hasattr(module, "is_available"):
        return False
    try:
        return bool(module.is_available())
    except Exception:  # noqa: BLE001 - a driver error means "not available"
        return False


def device_type(obj: Any = None) -> str:
    """The device type of ``obj`` (tensor, module, ``torch.device`` or string), or of this process.

    With ``obj=None`` it is the first available accelerator in the order npu, cuda, xpu, mps, else
    ``"cpu"``. A module's device type is that of its first parameter or buffer (``"cpu"`` if none).
    """
    if obj is None:
        return next((t for t in _ACCELERATORS if is_available(t)), "cpu")
    if isinstance(obj, torch.Tensor):  # the common case, on the data path: no parsing
        return obj.device.type
    return _kind_and_index(obj)[0]


def _process_device_type() -> str:
    """:func:`device_type` of this process, for functions whose ``device_type`` argument shadows it."""
    return device_type()


def _kind_and_index(obj: Any) -> tuple[str, int | None]:
    """``(device type, device index or None)`` of a tensor, module, ``torch.device`` or string."""
    if isinstance(obj, torch.nn.Module):
        tensor = next(obj.parameters(), None)
        if tensor is None:
            tensor = next(obj.buffers(), None)
        obj = torch.device("cpu") if tensor is None else tensor
    if isinstance(obj, torch.Tensor):
        obj = obj.device
    if isinstance(obj, torch.device):
        return obj.type, obj.index
    if isinstance(obj, str):  # parsed by hand: "npu" is a device type only once torch_npu is imported
        kind, _, index = obj.partition(":")
        return kind, int(index) if index else None
    raise TypeError(f"device_type(obj): expected a Tensor, Module, torch.device or str, got {type(obj).__name__}")


def current_device(device_type_: str | None = None) -> torch.device:
    """The device this process computes on: ``cuda:<current>``, ``npu:<current>``, or ``cpu``."""
    kind = device_type_ or device_type()
    module = device_module(kind)
    if kind == "cpu" or module is None or not hasattr(module, "current_device"):
        return torch.device(kind)
    return torch.device(kind, module.current_device())


def group_device(group: Any = None) -> torch.device:
    """The device ``group``'s collectives take tensors on: the CPU for gloo, else :func:`current_device`."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else current_device()


def synchronize(device: Any = None) -> None:
    """Wait for all work queued on ``device`` (default: this process's accelerator). No-op on CPU.

    ``device`` is a tensor, module, ``torch.device`` or string; without an index (``"cuda"``) it means
    the current device of that type. Needed before reading on the host a tensor a collective wrote on
    an NPU: HCCL runs on its own stream, which host reads are not ordered with (without it, counts
    read right after their exchange can be stale: garbage split sizes).
    """
    if isinstance(device, torch.device):  # the common case, on the data path: no parsing
        kind, index = device.type, device.index
    else:
        kind, index = _kind_and_index(device) if device is not None else (device_type(), None)
    if kind == "cpu":
        return
    module = device_module(kind)
    if module is None or not hasattr(module, "synchronize"):
        return
    module.synchronize(index)  # None: the current device


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor (offsets, indices) to ``device`` without blocking the host.

    From pinned memory the copy is asynchronous on the current stream; from pageable memory it would
    wait for every kernel queued before it (a hidden host synchronisation per call).
    """
    if torch.device(device).type == "cpu":
        return tensor
    if tensor.device.type != "cpu":  # already on a device (built from device counts)
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def comm_backend(device_type: str | None = None) -> str:
    """The ``torch.distributed`` backend for a device type (default: this process's): nccl, hccl,
    xccl, or gloo."""
    kind = device_type or _process_device_type()
    try:
        return _COMM_BACKENDS[kind]
    except KeyError:
        raise ValueError(f"comm_backend(device_type): unknown device type {kind!r}") from None


def device_capability(device: Any = None) -> tuple[int, int] | None:
    """``(major, minor)`` compute capability of a CUDA device, ``None`` for every other type."""
    kind, index = _kind_and_index(device) if device is not None else (device_type(), None)
    if kind != "cuda" or not is_available("cuda"):
        return None
    return tuple(device_module("cuda").get_device_capability(index))


def new_stream(device: Any) -> Any | None:
    """A new side stream on ``device`` (that device, not the current one, when it has an index), or
    ``None`` where there are no streams (CPU)."""
    kind, index = _kind_and_index(device)
    module = device_module(kind)
    if kind == "cpu" or module is None or not hasattr(module, "Stream"):
        return None
    return module.Stream(device=index)  # None: the current device


@contextlib.contextmanager
def stream(side_stream: Any | None) -> Iterator[None]:
    """Run the block on ``side_stream`` once it has waited for the current stream; no-op for ``None``."""
    if side_stream is None:
        yield
        return
    module = device_module(side_stream.device.type)
    side_stream.wait_stream(module.current_stream())
    with module.stream(side_stream):
        yield


def wait_stream(side_stream: Any | None) -> None:
    """Make the current stream wait for ``side_stream``; no-op for ``None``."""
    if side_stream is not None:
        device_module(side_stream.device.type).current_stream().wait_stream(side_stream)


def reset_peak_memory(device: Any) -> None:
    """Start counting ``device``'s peak allocated memory afresh (accelerators; no-op on CPU)."""
    module = device_module(device_type(device))
    if module is not None and hasattr(module, "reset_peak_memory_stats"):
        module.reset_peak_memory_stats(device)


def peak_memory(device: Any) -> int | None:
    """Bytes of ``device`` memory allocated at most since :func:`reset_peak_memory` (``None`` on CPU)."""
    module = device_module(device_type(device))
    if module is None or not hasattr(module, "max_memory_allocated"):
        return None
    return int(module.max_memory_allocated(device))
