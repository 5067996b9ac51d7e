"""The sampler's linear-attention state, beside the paged KV of the full-attention layers.

A Qwen3.5 sequence carries, for each linear-attention layer, a conv state [C, K-1] and a
delta-rule state [H, dk, dv] (linear_attn.py): a fixed size whatever its length, so it
lives in plain per-row buffers, not pages. The layers find it as `cache.recurrent`
(qwen35.py), an object with `initial(layer)` -> (conv [N, ...], state [N, ...]) or
(None, None) for fresh sequences, and `keep(layer, conv, state)`:
- prefill: `PieceStates`, one row per piece; a prompt's state (`PromptState`) goes from
  chunk to chunk of a long prompt and ends whole when its last piece ran;
- decode: `SlotStates.bound(n)`, the running batch's slots 0..n-1, updated in place.
Fan-out: the samples of one prompt each get a copy of the prompt's state when they are
seated (`SlotStates.seat`); their full-attention pages are shared as for any model.

The running batch (running.py) runs such a model only where the state is carried: the
varlen prefill, eager synchronous decode steps (a CUDA graph's warm-up, or a step launched
ahead and then redrawn, would step the state twice), no prefix cache (cached pages hold no
state) and no cascade.
"""

from __future__ import annotations

import torch


class PromptState:
    """One prompt's state after its prefilled positions: layer -> (conv [C, K-1], ssm
    [H, dk, dv]); empty before its first piece."""

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


class PieceStates:
    """A prefill pass's states: row j is piece j's prompt."""

    def __init__(self, prompts: list[PromptState]):
        self.prompts = prompts

    def initial(self, layer: int):
        got = [p.layers.get(layer) for p in self.prompts]
        if all(g is None for g in got):
            return None, None
        ref = next(g for g in got if g is not None)
        conv, ssm = (torch.stack([ref[j].new_zeros(ref[j].shape) if g is None else g[j]
                                  for g in got]) for j in (0, 1))
        return conv, ssm

    def keep(self, layer: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        for j, p in enumerate(self.prompts):
            p.layers[layer] = (conv[j], ssm[j])


class SlotStates:
    """Every running slot's state, for each linear-attention layer of `model`."""

    def __init__(self, model, rows: int):
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        dev = model.device
        for i in model.hybrid.linear:
            mod = model.layers[i].linear_attn
            k = mod.conv1d.weight.shape[-1]
            self.conv[i] = torch.zeros(rows, mod.conv_dim, k - 1, dtype=model.dtype, device=dev)
            self.ssm[i] = torch.zeros(rows, mod.num_v_heads, mod.head_k_dim, mod.head_v_dim,
                                      dtype=torch.float32, device=dev)

    @staticmethod
    def row_bytes(model) -> int:
        """One slot's state: fp32 delta-rule states (a bf16 copy would round the state
        at every step) and conv states in the model's dtype. Qwen3.5-9B: 48 MiB."""
        total = 0
        for i in model.hybrid.linear:
            mod = model.layers[i].linear_attn
            total += mod.num_v_heads * mod.head_k_dim * mod.head_v_dim * 4
            total += mod.conv_dim * (mod.conv1d.weight.shape[-1] - 1) * model.dtype.itemsize
        return total

    @staticmethod
    def fit(model, rows: int, kv_bytes: int) -> tuple[int, int]:
        """The rows a sampler of `kv_bytes` runs (their states take at most half of it)
        and the bytes left for its KV pages."""
        per_row = SlotStates.row_bytes(model)
        rows = max(1, min(rows, kv_bytes // 2 // per_row))
        return rows, kv_bytes - rows * per_row

    def bound(self, n: int) -> _Bound:
        return _Bound(self, n)

    def seat(self, first: int, prompts: list[PromptState]) -> None:
        """Slots first, first + 1, ... start from copies of their prompts' states."""
        for j, p in enumerate(prompts):
            for i, (conv, ssm) in p.layers.items():
                self.conv[i][first + j].copy_(conv)
                self.ssm[i][first + j].copy_(ssm)

    def move(self, src: int, dst: int) -> None:
        for buf in (*self.conv.values(), *self.ssm.values()):
            buf[dst] = buf[src]
            buf[src] = 0

    def clear(self, slot: int) -> None:
        for buf in (*self.conv.values(), *self.ssm.values()):
            buf[slot] = 0


class _Bound:
    """Slots 0..n-1 of a decode step."""

    def __init__(self, states: SlotStates, n: int):
        self.states, self.n = states, n

    def initial(self, layer: int):
        return self.states.conv[layer][:self.n], self.states.ssm[layer][:self.n]

    def keep(self, layer: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        self.states.conv[layer][:self.n].copy_(conv)
        self.states.ssm[layer][:self.n].copy_(ssm)
