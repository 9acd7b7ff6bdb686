"""Which accelerator a worker runs on: NPU (torch_npu), then CUDA, then CPU, unless told."""

from __future__ import annotations

import importlib
import logging

import torch

logger = logging.getLogger(__name__)


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    except Exception as exc:  # torch_npu present but CANN missing or broken
        logger.warning("torch_npu is installed but failed to load (%s); not using NPUs", exc)
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def resolve_device(spec: str = "auto") -> torch.device:
    """ "auto", or an explicit torch device such as "cpu", "cuda:1", "npu:3"."""
    if spec == "auto":
        if _npu_available():
            return torch.device("npu:0")
        if torch.cuda.is_available():
            return torch.device("cuda:0")
        return torch.device("cpu")
    if spec.startswith("npu") and not _npu_available():
        raise RuntimeError(f"device {spec!r} requested but torch_npu/CANN is not available")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {spec!r} requested but CUDA is not available")
    return device
