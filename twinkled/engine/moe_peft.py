"""Expert LoRA in peft's form: tensor names and layouts of `target_parameters` adapters.

peft 0.21 adapts a 3-D expert parameter [E, out, in] with a `ParamWrapper` holding
lora_A [E * r, in] (expert e's A is rows e*r .. e*r + r) and lora_B [out, r * E] (expert
e's B is columns e, E + e, 2E + e, ...): `lora_B.reshape(out, r, E)`. Two parameters of
one module are wrapped one inside the other, the module's first parameter innermost, so
`mlp.experts.gate_up_proj` is saved under `mlp.experts.base_layer.lora_A.weight` and
`mlp.experts.down_proj` under `mlp.experts.lora_A.weight`. The bank keeps A [E, r, in]
and B [E, out, r]; these functions convert between the two, both ways, exactly.
"""

from __future__ import annotations

import torch

from twinkled.protocol.types import EXPERT_MODULES, EngineInputError

_INNER = f".experts.{EXPERT_MODULES[0]}"  # gate_up_proj: wrapped first, saved as base_layer
_OUTER = f".experts.{EXPERT_MODULES[1]}"


def is_expert(key: str) -> bool:
    return key.endswith((_INNER, _OUTER))


def peft_module(key: str) -> str:
    """The module path peft saves `key`'s lora_A / lora_B under."""
    if key.endswith(_INNER):
        return key[: -len(_INNER)] + ".experts.base_layer"
    if key.endswith(_OUTER):
        return key[: -len(_OUTER)] + ".experts"
    return key


def key_of_module(module: str) -> str:
    """The inverse of `peft_module`."""
    if module.endswith(".experts.base_layer"):
        return module[: -len(".experts.base_layer")] + _INNER
    if module.endswith(".experts"):
        return module + "." + EXPERT_MODULES[1]
    return module


def peft_parameters(keys) -> list[str]:
    """adapter_config's `target_parameters` for these bank keys (peft matches by suffix)."""
    return sorted({"mlp.experts." + k.rsplit(".", 1)[-1] for k in keys if is_expert(k)},
                  key=lambda n: EXPERT_MODULES.index(n.rsplit(".", 1)[-1]))


def to_peft(key: str, part: str, t: torch.Tensor) -> torch.Tensor:
    """A bank tensor (A [E, r, in] or B [E, out, r]) in peft's layout (2-D keys unchanged)."""
    if not is_expert(key):
        return t
    if part == "lora_A":
        return t.reshape(-1, t.shape[-1])
    return t.permute(1, 2, 0).reshape(t.shape[1], -1)


def from_peft(key: str, a: torch.Tensor, b: torch.Tensor, rank: int,
              shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's lora_A, lora_B of `key` in the bank's layout; `shape` is the target's
    (in, out) or (in, out, experts). Raises EngineInputError on a shape mismatch."""
    fin, fout, *experts = shape
    E = experts[0] if experts else 1
    if a.shape != (E * rank, fin) or b.shape != (fout, rank * E):
        raise EngineInputError("weights", f"{key}: expected lora_A {(E * rank, fin)} and "
                               f"lora_B {(fout, rank * E)} for this base model")
    if not experts:
        return a, b
    return a.reshape(E, rank, fin), b.reshape(fout, rank, E).permute(2, 0, 1)
