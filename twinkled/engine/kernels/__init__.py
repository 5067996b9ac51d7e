"""Triton kernels for the GPU hot paths, each beside the reference (torch) path it replaces.

On CUDA they run compiled and are on by default (`available`). On CPU they run only in
Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported; tests/conftest.py
sets it), and only where a caller asks for them explicitly: that is how the tests check
each kernel against its reference path, and why a CPU daemon never takes them.
"""

from __future__ import annotations

import os

import torch


def importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(device: torch.device) -> bool:
    """Whether the kernel paths are the default on `device`: CUDA with triton importable."""
    return device.type == "cuda" and importable()


def runnable(device: torch.device) -> bool:
    """Whether a caller may ask for the kernel paths on `device` (CPU: interpreter only)."""
    if device.type == "cuda":
        return importable()
    return os.environ.get("TRITON_INTERPRET") == "1" and importable()
