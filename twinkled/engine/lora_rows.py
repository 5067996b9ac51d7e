"""The adapters of a running sampling batch, side by side, for rows that come and go.

`LoraBatch` (lora.py) wants a bank's rows contiguous and gathers every row's own copy of
its adapter's weights; in continuous batching rows join and leave at every step, and a
decode step that gathers per row reads (rows x adapter size) bytes of LoRA weights, far
more than the base model's. Here every adapter in use gets a range of columns in one
stack per target module (A: [width, in], B: [out, width]); a row picks its adapter's
columns with a mask row that carries the adapter's scale (zero elsewhere). A mixed batch's
delta is then two dense matmuls that read each adapter once per step, with shapes that do
not depend on which row uses which adapter, so one captured CUDA graph serves every mix.
The other adapters' columns cost flops, which decode has to spare.

Weights are copied in when an adapter gets its first running row (so training between
two sampling calls is seen), and its columns are freed when its last row finishes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .lora import Adapter


class AdapterStack:
    def __init__(self, dtype: torch.dtype, device: torch.device, width: int = 64):
        self.dtype, self.device = dtype, device
        self.width = width
        self.A: dict[str, torch.Tensor] = {}  # target key -> [width, in]
        self.B: dict[str, torch.Tensor] = {}  # target key -> [out, width]
        self._owner: list[str | None] = [None] * width  # adapter id per column
        self._held: dict[str, tuple[Adapter, int, int]] = {}  # id -> (adapter, start, users)
        self._loaded: dict[str, int] = {}  # id -> the weights version its columns hold
        self.version = 0  # changes when the buffers are reallocated or gain a target

    def acquire(self, adapter: Adapter) -> None:
        """One more running row of `adapter` (its weights are copied in for the first)."""
        held = self._held.get(adapter.id)
        if held is not None and held[0] is adapter:
            self._held[adapter.id] = (adapter, held[1], held[2] + 1)
            return
        if held is not None:  # a removed adapter's id reused: never while rows run
            raise RuntimeError(f"adapter {adapter.id!r} changed while rows sample it")
        start = self._columns(adapter.config.rank)
        self._load(adapter, start)
        self._held[adapter.id] = (adapter, start, 1)

    def weights_version(self, adapter: Adapter) -> int:
        """The version (`Adapter.version`) of the weights a held adapter's columns hold:
        they were copied at its first running row, so an optimizer step since is not in them."""
        return self._loaded[adapter.id]

    def release(self, adapter: Adapter) -> None:
        a, start, users = self._held[adapter.id]
        if users > 1:
            self._held[adapter.id] = (a, start, users - 1)
            return
        del self._held[adapter.id]
        del self._loaded[adapter.id]
        for c in range(start, start + a.config.rank):
            self._owner[c] = None

    def mask_row(self, adapter: Adapter | None) -> torch.Tensor:
        """The [width] mask that selects `adapter`'s columns (zeros: the base model)."""
        row = torch.zeros(self.width, dtype=self.dtype)
        if adapter is not None:
            _, start, _ = self._held[adapter.id]
            row[start:start + adapter.config.rank] = adapter.scale
        return row

    def _columns(self, rank: int) -> int:
        run = 0
        for c, owner in enumerate(self._owner):
            run = run + 1 if owner is None else 0
            if run == rank:
                return c - rank + 1
        start = self.width - run  # the free run at the end, if any, continues in the growth
        while self.width - start < rank:
            self._grow()
        return start

    def _grow(self) -> None:
        old, self.width = self.width, 2 * self.width
        self._owner += [None] * old
        for key in self.A:
            a = torch.zeros((self.width, self.A[key].shape[1]), dtype=self.dtype, device=self.device)
            b = torch.zeros((self.B[key].shape[0], self.width), dtype=self.dtype, device=self.device)
            a[:old], b[:, :old] = self.A[key], self.B[key]
            self.A[key], self.B[key] = a, b
        self.version += 1

    @torch.no_grad()
    def _load(self, adapter: Adapter, start: int) -> None:
        bank, r = adapter.bank, adapter.config.rank
        bank.refresh()  # the compute-dtype copy follows the fp32 masters
        self._loaded[adapter.id] = adapter.version
        for c in range(start, start + r):
            self._owner[c] = adapter.id
        for key in bank.shapes:
            if key not in self.A:
                fin, fout = bank.shapes[key]
                self.A[key] = torch.zeros((self.width, fin), dtype=self.dtype, device=self.device)
                self.B[key] = torch.zeros((fout, self.width), dtype=self.dtype, device=self.device)
                self.version += 1
        for key in self.A:  # columns may hold a previous owner's weights: clear untargeted
            if key in bank.shapes:
                self.A[key][start:start + r] = bank.A16[key][adapter.slot]
                self.B[key][:, start:start + r] = bank.B16[key][adapter.slot]
            else:
                self.A[key][start:start + r] = 0
                self.B[key][:, start:start + r] = 0


class RowLora:
    """The `lora.apply(key, x, y)` of a batch whose row b uses the columns `mask[b]` picks.
    Sampling only (no autograd): the delta is added into `y`, the base linear's fresh
    output, by one fused matmul-add."""

    def __init__(self, stack: AdapterStack, mask: torch.Tensor):
        self.stack, self.mask = stack, mask

    def apply(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = self.stack.A.get(key)
        if a is None:
            return y
        h = F.linear(x, a) * self.mask[:, None, :]
        y.view(-1, y.shape[-1]).addmm_(h.view(-1, h.shape[-1]), self.stack.B[key].t())
        return y
