"""Triton kernels for the GPU hot paths, each beside the reference (torch) path it replaces.

On CUDA they run compiled; on CPU only in Triton's interpreter (TRITON_INTERPRET=1, set
before this package is imported), which is how the tests check each kernel against its
reference path. `available(device)` says whether a kernel path can run on a device.
"""

from __future__ import annotations

import os

import torch


def available(device: torch.device) -> bool:
    """Triton importable, and the device is CUDA (or the interpreter is on, for tests)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
