"""Which accelerator a worker runs on: NPU (torch_npu), then CUDA, then CPU, unless told."""

from __future__ import annotations

import importlib
import logging
import os

import torch

logger = logging.getLogger(__name__)

CANN_HINT = (
    "torch_npu could not load; is CANN installed and its environment sourced "
    "(`. /usr/local/Ascend/ascend-toolkit/set_env.sh`), and are the /dev/davinci* devices and the driver mounted?"
)


def _load_torch_npu() -> Exception | None:
    """None when torch_npu loaded; otherwise why not (ImportError: not installed)."""
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # installed but CANN missing or broken: any error, not only ImportError
        return exc
    return None


def _npu_available() -> bool:
    error = _load_torch_npu()
    if isinstance(error, ImportError) and error.name == "torch_npu":
        return False
    if error is not None:
        logger.warning("torch_npu is installed but failed to load (%s); not using NPUs", error)
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def _require_npu(spec: str) -> None:
    error = _load_torch_npu()
    if error is not None:
        raise RuntimeError(f"device {spec!r} requested: {CANN_HINT} ({type(error).__name__}: {error})")
    if not torch.npu.is_available():
        raise RuntimeError(f"device {spec!r} requested but no NPU is visible: {CANN_HINT}")


def resolve_device(spec: str = "auto", accelerator: str = "") -> torch.device:
    """ "auto", or an explicit torch device such as "cpu", "cuda:1", "npu:3".

    `accelerator` (the `accelerator` setting: npu, cuda or cpu) makes "auto" insist on one kind, so an NPU
    image without CANN stops with a clear message instead of quietly serving from the CPU.
    """
    if spec == "auto" and accelerator:
        spec = "cpu" if accelerator == "cpu" else f"{accelerator}:0"
    if spec == "auto":
        if _npu_available():
            return torch.device("npu:0")
        if torch.cuda.is_available():
            return torch.device("cuda:0")
        return torch.device("cpu")
    if spec.startswith("npu"):
        _require_npu(spec)
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = (
            f" (CUDA_VISIBLE_DEVICES={visible}: is there a GPU with that id? npuDeviceIds names them)"
            if visible
            else ""
        )
        raise RuntimeError(f"device {spec!r} requested but CUDA is not available{where}")
    return device


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. On an accelerator through pinned memory, without waiting: a copy from
    ordinary (pageable) memory first waits until the device's queue has drained, which would stall the
    host at every step's metadata instead of letting it prepare the next step while the device runs."""
    if device.type in ("cpu", "meta") or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def host_to(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy a host tensor into a device buffer (a captured graph's), as `to_device` copies."""
    on_host = target.device.type in ("cpu", "meta") or source.device.type != "cpu"
    target.copy_(source if on_host else source.pin_memory(), non_blocking=True)


def release_device_memory(device: torch.device) -> None:
    """Hand the device's cached free blocks back to its driver (what it reports free, and the KV pool
    is sized from, counts them as used)."""
    backend = getattr(torch, device.type, None)
    empty_cache = getattr(backend, "empty_cache", None)
    if device.type != "cpu" and callable(empty_cache):
        empty_cache()
