"""Fused kernels of the decoder layer (issues 31/32): fewer, bigger kernels on the hot path.

A layer run op by op costs ~1,000 small kernels a decode step and ~7,000 ops a training step
on an 8B model: HF's RMSNorm is ~6 kernels, the rotation ~5 per tensor, SiLU * up 2, and
q/k/v and gate/up are 5 GEMMs where 2 would do. `Fused` holds one lever per fusion so each
can be switched (and measured) alone; all off is the reference path.

- norm: RMSNorm, and the residual add fused with the next RMSNorm (liger-kernel).
- rope: q's and k's rotation in one kernel (liger-kernel).
- silu: SiLU(gate) * up in one kernel, reading gate/up straight from the fused GEMM's output.
- gemm: one GEMM for q/k/v and one for gate/up, on weights concatenated at load
  (`concat_linears`: the modules' weights become views of the one tensor, no extra memory).
- prep: a decode step on the paged kernel's view (CUDA) norms and rotates q and k and stores
  k and v in one Triton kernel of ours (kernels/qk_prep.py); off: the levers above, then
  the KV store (the reference path).

The kernels are liger-kernel's (Triton, forward and backward), used on CUDA. Elsewhere (and
where liger is not installed) the same functions run eager torch with HF's math, so the
fused layer's structure (the split GEMM outputs, the add + norm order) still runs.
tests/test_fused_layer.py checks both against the reference; on CPU liger's kernels run in
Triton's interpreter there (tests/liger_interpret.py fills the interpreter's gaps).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass
class Fused:
    norm: bool = True
    rope: bool = True
    silu: bool = True
    gemm: bool = True
    prep: bool = True

    @classmethod
    def off(cls) -> Fused:
        return cls(**{n: False for n in LEVERS})

    @classmethod
    def parse(cls, spec: str) -> Fused:
        """"all", "none" or levers comma-separated ("norm,gemm"): the bench's switch."""
        if spec == "all":
            return cls()
        names = set() if spec == "none" else set(spec.split(","))
        bad = names - set(LEVERS)
        if bad:
            raise ValueError(f"unknown fused levers {sorted(bad)}")
        return cls(**{n: n in names for n in LEVERS})


LEVERS = ("norm", "rope", "silu", "gemm", "prep")


def liger_usable(device: torch.device) -> bool:
    """liger-kernel's Triton kernels can run here: a CUDA device and the package installed."""
    if device.type != "cuda":
        return False
    try:
        import liger_kernel.ops.rms_norm  # noqa: F401
    except ImportError:
        log.warning("liger-kernel is not installed (the `gpu` extra): the decoder layer's "
                    "norms, rotary and SiLU run op by op")
        return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel: bool) -> torch.Tensor:
    """HF's Llama RMSNorm: the mean square in fp32, the weight applied in x's dtype."""
    if kernel:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", True)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one kernel: a layer's residual add and the
    norm after it."""
    if kernel:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        return LigerFusedAddRMSNormFunction.apply(x, residual, weight, eps, 0.0, "llama", False)
    s = residual + x
    return rms_norm(s, weight, eps, False), s


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: bool
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, S, D] and k [B, Hkv, S, D] rotated (half-split layout, as the HF Llama family
    stores it); cos/sin [B or 1, S, D]. The kernel rotates a contiguous input in place: the
    layer's q and k are fresh tensors nothing else holds (a view of the fused GEMM's output
    is not contiguous, so the kernel copies it first)."""
    if kernel:
        from liger_kernel.ops.rope import LigerRopeFunction

        return LigerRopeFunction.apply(q, k, cos, sin)
    return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding op by op (the reference path)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul(gate: torch.Tensor, up: torch.Tensor, kernel: bool,
             joint: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(gate) * up. `joint`: the [..., 2F] tensor gate and up are still the two halves of
    (the fused gate/up GEMM's output), read in place by the kernel without copies."""
    if not kernel:
        return F.silu(gate) * up
    if joint is not None and _halves_of(joint, gate, up):
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

        # 2-D in and out: its backward returns the gradient flattened to [rows, 2F]
        flat = LigerFusedGateUpSiLUMulFunction.apply(joint.view(-1, joint.shape[-1]))
        return flat.view(*gate.shape)
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(gate, up)


def _halves_of(joint: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> bool:
    """gate and up are still joint's two halves: a LoRA that added its delta in place keeps
    them so; one that made new tensors (y + d) does not."""
    f = gate.shape[-1]
    return (joint.is_contiguous() and joint.shape[-1] == 2 * f
            and gate.data_ptr() == joint.data_ptr()
            and up.data_ptr() == joint.data_ptr() + f * joint.element_size())


@dataclass
class Joint:
    """Linears reading the same x, run as one GEMM: `weight`/`bias` the concatenation (the
    modules' own weights are views of it), `sizes` each module's out features."""
    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: list[int]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The joint output and each module's part of it: views one by one (`narrow`, not
        `split`, whose views autograd will not let a LoRA add into in place)."""
        y = F.linear(x, self.weight, self.bias)
        parts, start = [], 0
        for n in self.sizes:
            parts.append(y.narrow(-1, start, n))
            start += n
        return y, parts


def layer_joints(layers, moe, plain_attention: bool) -> list[dict[str, Joint]]:
    """Each decoder layer's q/k/v ("attn", where `plain_attention`: not Qwen3.5's q_proj,
    which holds a gate, nor MLA's) and dense gate/up ("mlp", not the layers in `moe`) as one
    Joint each (concat_linears)."""
    joints = []
    for i, layer in enumerate(layers):
        group = {}
        if plain_attention:
            a = layer.self_attn
            group["attn"] = concat_linears([a.q_proj, a.k_proj, a.v_proj])
        if i not in moe:
            group["mlp"] = concat_linears([layer.mlp.gate_proj, layer.mlp.up_proj])
        joints.append({k: v for k, v in group.items() if v is not None})
    return joints


def concat_linears(modules: list[torch.nn.Module]) -> Joint | None:
    """Concatenate the linears' weights (and biases) into one tensor and make each module's
    weight a view of it, so everything else that reads module.weight (LoRA shapes, tensor
    parallel shards, the reference path) sees the same values and no memory is added.
    None where they cannot share one GEMM (mixed dtypes or devices, some with a bias)."""
    ws = [m.weight for m in modules]
    bs = [m.bias for m in modules]
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1:
        return None
    if any(b is None for b in bs) and not all(b is None for b in bs):
        return None
    weight = _concat_into_views(ws)
    bias = None if bs[0] is None else _concat_into_views(bs)
    return Joint(weight, bias, [w.shape[0] for w in ws])


def _concat_into_views(params: list[torch.Tensor]) -> torch.Tensor:
    joint = torch.cat([p.detach() for p in params], 0)
    start = 0
    for p in params:
        n = p.shape[0]
        p.data = joint[start:start + n]  # the module keeps its Parameter; its data is a view
        start += n
    return joint
