"""The LoRA row kernels and the sampling kernel compile for a GPU (sm_90, Triton's own PTX
backend, no GPU needed; in a process of its own, since the suite runs Triton's interpreter).

The other kernel tests run them in Triton's interpreter, which accepts code the compiler
rejects (a value whose type differs between the branches of an `if`, say): this catches that
on a CPU, before a GPU machine's first decode step would. Integer arguments equal to 1 are
compiled as constants by Triton's launcher; the second signature covers that case (a module
of one column block, one row)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from twinkled.engine.kernels import lora_decode as ld

ROWS = ("order_ptr", "seg_ptr", "start_ptr", "rank_ptr")
dtype, precision = sys.argv[1], sys.argv[2]


def ptx(kernel, consts):
    types = {n: "*i32" if n in ROWS else "*fp32" if n in ("h_ptr", "scale_ptr")
             else "*" + dtype for n in kernel.arg_names if n.endswith("_ptr")}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


common = {"BM": ld.BM, "RB": 32, "PRECISION": precision, "DYN_FOR": True}
assert ".entry _shrink" in ptx(ld._shrink, {**common, "CHUNK": 128})
for split in (1, 16):
    consts = {**common, "SPLIT": split, "BN": ld.BN}
    assert ".entry _expand" in ptx(ld._expand, consts)
    assert ".entry _expand" in ptx(ld._expand, {**consts, "end0": 1, "n": 1})
print("compiled")
"""


# kernels/sample_rows.py: bf16 or fp32 logits; B and the row stride 1 (one row of one
# token's width) compiled as constants
SAMPLE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from twinkled.engine.kernels import sample_rows as sr

k = sr._sample_rows
types = {"x_ptr": "*" + sys.argv[1], "tok_ptr": "*i64"}
for consts in ({}, {"B": 1, "stride_row": 1}):
    c = {"ROWS": sr.ROWS, "BLOCK": sr.BLOCK, **consts}
    sig = {n: "constexpr" if n in c else types.get(n, "*fp32" if n.endswith("_ptr") else "i32")
           for n in k.arg_names}
    src = ASTSource(fn=k, signature=sig, constexprs=c)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": sr.NUM_WARPS})
    assert ".entry _sample_rows" in out.asm["ptx"]
print("compiled")
"""


def _compile(script: str, *args: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", script, *args], env=env,
                         capture_output=True, text=True, timeout=300)
    if run.returncode and "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.skip("Triton without the NVIDIA backend's ptxas")
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("dtype,precision", [("bf16", "tf32"), ("fp32", "ieee")])
def test_the_lora_row_kernels_compile_for_sm90(dtype, precision):
    _compile(COMPILE, dtype, precision)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_sampling_kernel_compiles_for_sm90(dtype):
    _compile(SAMPLE, dtype)
