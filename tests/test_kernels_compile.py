"""The LoRA row kernels, the sampling kernel and the decode step's q/k prep kernel compile
for a GPU (sm_90, Triton's own PTX backend, no GPU needed; in a process of its own, since
the suite runs Triton's interpreter).

The other kernel tests run them in Triton's interpreter, which accepts code the compiler
rejects (a value whose type differs between the branches of an `if`, say): this catches that
on a CPU, before a GPU machine's first decode step would, and a kernel that wants more
shared memory than the card has (an unrolled loop's loads, all in flight). Integer arguments equal to 1 are
compiled as constants by Triton's launcher; the second signature covers that case (a module
of one column block, one row)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# Each script runs in a process of its own (the suite's runs Triton's interpreter).
PRELUDE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
"""

COMPILE = PRELUDE + """
from twinkled.engine.kernels import lora_decode as ld

ROWS = ("order_ptr", "seg_ptr", "start_ptr", "rank_ptr")
dtype, precision = sys.argv[1], sys.argv[2]


SMEM = 227 * 1024  # an H100's or H200's shared memory a block may take


def ptx(kernel, consts):
    types = {n: "*i32" if n in ROWS else "*fp32" if n in ("h_ptr", "scale_ptr")
             else "*" + dtype for n in kernel.arg_names if n.endswith("_ptr")}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert out.metadata.shared <= SMEM, (kernel.fn.__name__, consts, out.metadata.shared)
    return out.asm["ptx"]


common = {"BM": ld.BM, "RB": 32, "PRECISION": precision, "DYN_FOR": True}
chunk = ld.CHUNK[2 if dtype == "bf16" else 4]
for iters in (1, 3, 12):  # 12: the 8B's down projection (12,288) in 8 partials of fp32 chunks
    assert ".entry _shrink" in ptx(ld._shrink, {**common, "CHUNK": chunk, "ITERS": iters})
for split in (1, 16):
    consts = {**common, "SPLIT": split, "BN": ld.BN, "NB": ld.NB}
    assert ".entry _expand" in ptx(ld._expand, consts)
    assert ".entry _expand" in ptx(ld._expand, {**consts, "end0": 1, "n": 1})
print("compiled")
"""


# kernels/sample_rows.py: bf16 or fp32 logits; B and the row stride 1 (one row of one
# token's width) compiled as constants
SAMPLE = PRELUDE + """
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


# kernels/qk_prep.py: bf16 or fp32 heads and pools, with and without q/k norms, head dims of
# 128 and 64; the unit strides of the head dimension compiled as constants (as the launcher
# does with the GEMM's views)
QK_PREP = PRELUDE + """
from twinkled.engine.kernels import qk_prep as qp

k = qp._qk_prep
types = {"slot_ptr": "*i64", "q_eps": "fp32", "k_eps": "fp32"}
for norm in (True, False):
    for dim in (128, 64):
        c = {"HQ": 32, "HALF": dim // 2, "HALF_PAD": dim // 2, "NORM": norm,
             "sq_d": 1, "sk_d": 1, "sv_d": 1}
        sig = {n: "constexpr" if n in c else types.get(
            n, "*" + sys.argv[1] if n.endswith("_ptr") else "i32") for n in k.arg_names}
        out = triton.compile(ASTSource(fn=k, signature=sig, constexprs=c),
                             target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": qp.NUM_WARPS})
        assert ".entry _qk_prep" in out.asm["ptx"]
print("compiled")
"""


# kernels/paged_decode.py's split kernel, writing partials or (DIRECT: one part a row) the
# output in the model's dtype, alone and after a prefix (START)
PAGED = PRELUDE + """
from twinkled.engine.kernels import paged_decode as pd

k = pd._split_kernel
dtype = sys.argv[1]
for direct in (True, False):
    for start in (False, True):
        out = "*" + dtype if direct else "*fp32"
        types = {"q_ptr": "*" + dtype, "k_ptr": "*" + dtype, "v_ptr": "*" + dtype,
                 "table_ptr": "*i32", "len_ptr": "*i32", "start_ptr": "*i32",
                 "m_ptr": "*fp32", "l_ptr": "*fp32", "o_ptr": out, "scale_log2": "fp32"}
        c = {"START": start, "G": 4, "G_PAD": 16, "D": 128, "BLOCK_D": 128,
             "BLOCK_N": pd.BLOCK_N, "PAGE": 16, "TILES": 4, "IEEE": dtype == "fp32",
             "TO_LENGTH": True, "DIRECT": direct}
        sig = {n: "constexpr" if n in c else types.get(n, "i32") for n in k.arg_names}
        got = triton.compile(ASTSource(fn=k, signature=sig, constexprs=c),
                             target=GPUTarget("cuda", 90, 32), options={"num_stages": 3})
        assert ".entry _split_kernel" in got.asm["ptx"]
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


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_qk_prep_kernel_compiles_for_sm90(dtype):
    _compile(QK_PREP, dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_paged_decode_kernel_compiles_for_sm90(dtype):
    _compile(PAGED, dtype)
