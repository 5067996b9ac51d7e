"""fla-core's decode kernel as engine/linear_attn.py calls it, run on the CPU by Triton's
interpreter (conftest sets TRITON_INTERPRET=1), against the torch delta rule: the arguments we
pass (shapes, keywords, scale, l2norm in kernel) are checked without a GPU. Runs where fla-core
is installed (the `gpu` extra; not in CI's test extra: transformers' own Qwen3.5, the tests'
reference, switches to fla's kernels when it is importable, and those need a GPU driver). A positional `beta` once landed in fla's `gk` slot and decoded NaN on CUDA. (The chunked
kernel asks Triton's driver for the device and cannot run interpreted: tests/test_qwen35_gpu.py
checks it on a GPU.)"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import delta_rule_inputs

from twinkled.engine import linear_attn as la

pytest.importorskip("triton")
pytest.importorskip("fla.ops.gated_delta_rule")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (CPU tensors)", allow_module_level=True)


def _heads(q, k, rep):
    q, k = (la.l2norm(t.float().repeat_interleave(rep, dim=2)) for t in (q, k))
    return q * q.shape[-1]**-0.5, k


def test_fla_step_equals_the_torch_step():
    (q, k, v, gate, beta, s0), _ = delta_rule_inputs([1, 1, 1], dk=16, dv=16)
    o, s = la.fla_step(q, k, v, gate, beta, s0)
    o2, s2 = la.delta_step(*_heads(q, k, 2), v, gate, beta, s0)
    assert torch.isfinite(o).all()
    assert (o.float() - o2).abs().max() < 1e-4 and (s - s2).abs().max() < 1e-4

