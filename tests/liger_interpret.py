"""liger-kernel's Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets), so the CPU tests run the fused layer's real kernels, forward and
backward. Triton 3.6's interpreter lacks three things those kernels use; this fills them in
for the test process only (compiled Triton on a GPU needs none of it):
- a Python float argument (eps, offset) stays a float, and `offset.to(...)` fails: pass it
  as an fp32 scalar, as compiled Triton does;
- libdevice's `rsqrt` has no interpreter version: use `tl.rsqrt`, the same function;
- `range(start, min(...))` of scalars calls int() on a 1-element array, an error under
  numpy 2: read the element.
"""

from __future__ import annotations

import os

import torch

from twinkled.engine.fused_ops import liger_usable


def kernels_here(device: str) -> bool:
    """liger's kernels can run on `device` in this test process (patching the interpreter
    where it is the CPU)."""
    if device != "cpu":
        return liger_usable(torch.device(device))
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import liger_kernel.ops.fused_add_rms_norm as add_norm
        import liger_kernel.ops.rms_norm as norm
        import liger_kernel.ops.rope  # noqa: F401
        import liger_kernel.ops.swiglu  # noqa: F401
    except ImportError:
        return False
    _patch(norm, add_norm)
    return True


def _patch(*modules) -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_twinkle_patched", False):
        return
    convert = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32),
                                                      tl.float32), tl.float32)
        return convert(arg)

    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    interpreter._implicit_cvt = implicit_cvt
    interpreter._patch_lang_tensor = patch_lang_tensor
    for m in modules:  # looked up when the kernel runs, where tl.rsqrt is the interpreter's
        m.rsqrt = lambda x: tl.rsqrt(x)
    interpreter._twinkle_patched = True
