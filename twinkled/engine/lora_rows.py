"""The adapters of a running sampling batch, side by side, for rows that come and go.

`LoraBatch` (lora.py) wants a bank's rows contiguous and gathers every row's own copy of
its adapter's weights; in continuous batching rows join and leave at every step, and a
decode step that gathers per row reads (rows x adapter size) bytes of LoRA weights, far
more than the base model's. Here every adapter in use gets a range of columns in one
stack per target module (A: [width, in], B: [out, width]); a row picks its adapter's
columns with a mask row that carries the adapter's scale (zero elsewhere). A mixed batch's
delta is then two dense matmuls that read each adapter once per step, with shapes that do
not depend on which row uses which adapter, so one captured CUDA graph serves every mix.
The other adapters' columns cost flops, which decode has to spare at a few adapters; at
many (64 of rank 32: 2048 columns on every row) they do not, and where the kernels run
(`kernels.lora_decode`) a row instead carries its adapter's (start, rank, scale) and reads
only its own columns (`KernelRowLora`); the masked `RowLora` stays as their reference.

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
        self.rank_block = 16  # a power of two >= every rank held (the kernels' column tile)

    def acquire(self, adapter: Adapter) -> None:
        """One more running row of `adapter` (its weights are copied in for the first)."""
        held = self._held.get(adapter.id)
        if held is not None and held[0] is adapter:
            self._held[adapter.id] = (adapter, held[1], held[2] + 1)
            return
        if held is not None:  # a removed adapter's id reused: never while rows run
            raise RuntimeError(f"adapter {adapter.id!r} changed while rows sample it")
        rank = adapter.config.rank
        if rank > self.rank_block:  # the kernels tile by it: captured graphs must go
            self.rank_block = 1 << (rank - 1).bit_length()
            self.version += 1
        start = self._columns(rank)
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

    def row(self, adapter: Adapter | None) -> tuple[int, int, float]:
        """`adapter`'s (first column, rank, scale); (0, 0, 0.0): the base model."""
        if adapter is None:
            return 0, 0, 0.0
        _, start, _ = self._held[adapter.id]
        return start, adapter.config.rank, adapter.scale

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
            if key not in self.A and len(bank.shapes[key]) == 2:  # (experts: moe.ExpertRows)
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
    output.

    The delta is added by one fused matmul-add (`addmm_`, one rounding of the sum), as the
    trainer's LoraBatch adds an adapter's rows (lora_fused.py): where the two sides round
    differently in bf16, every later rounding falls apart, and that one difference was the
    whole of the sampler/trainer logprob gap on CPU (0.011 nats a token on a 4-layer
    model; docs/reference.md "Sampler vs trainer logprobs")."""

    def __init__(self, stack: AdapterStack, mask: torch.Tensor):
        self.stack, self.mask = stack, mask

    def apply(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = self.stack.A.get(key)
        if a is None:
            return y
        h = F.linear(x, a) * self.mask[:, None, :]
        y.view(-1, y.shape[-1]).addmm_(h.view(-1, h.shape[-1]), self.stack.B[key].t())
        return y

    def row_factors(self, key: str):
        """(A [width, in], B [out, width], each row's column mask with its scale [rows,
        width]) of `key`, None where no adapter in the stack targets it: what a caller that
        applies the LoRA in pieces of its own needs (mla.py's absorbed decode)."""
        a = self.stack.A.get(key)
        return None if a is None else (a, self.stack.B[key], self.mask)


class KernelRowLora:
    """`RowLora` through the kernels: row b reads only the columns start[b] to start[b] +
    rank[b] (rank 0: the base model), scaled by scale[b]. Rows of several tokens (prefill)
    use their row's adapter for every token."""

    def __init__(self, stack: AdapterStack, start: torch.Tensor, rank: torch.Tensor,
                 scale: torch.Tensor):
        self.stack, self.rows = stack, (start, rank, scale)
        self._plans: dict[int, object] = {}  # tokens per row -> the rows sorted by adapter

    def apply(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return kernel_group(self.stack, lambda: self._plan(x.shape[1]), (key,), x, [y])[0]

    def apply_shared(self, keys: tuple[str, ...], x: torch.Tensor,
                     ys: list[torch.Tensor]) -> list[torch.Tensor]:
        """`apply` for modules that read the same x (q/k/v; gate/up): one launch pair."""
        return kernel_group(self.stack, lambda: self._plan(x.shape[1]), keys, x, ys)

    def _plan(self, tokens: int):
        """The rows sorted by adapter for rows of `tokens` tokens: once per forward (every
        module shares it), inside the graph."""
        plan = self._plans.get(tokens)
        if plan is None:
            from .kernels import lora_decode  # triton: only where the kernels run

            plan = self._plans[tokens] = lora_decode.plan(
                *(t.repeat_interleave(tokens) for t in self.rows))
        return plan

    def row_factors(self, key: str):
        """RowLora.row_factors: the mask built from each row's (start, rank, scale)."""
        a = self.stack.A.get(key)
        if a is None:
            return None
        start, rank, scale = self.rows
        cols = torch.arange(self.stack.width, device=start.device)
        mine = (cols[None] >= start[:, None]) & (cols[None] < (start + rank)[:, None])
        return a, self.stack.B[key], (mine * scale[:, None]).to(a.dtype)


def kernel_group(stack: AdapterStack, plan, keys: tuple[str, ...], x: torch.Tensor,
                 ys: list[torch.Tensor]) -> list[torch.Tensor]:
    """The LoRA deltas of modules that read the same x added to their outputs `ys` in place,
    through the row kernels: one shrink and one expand for the group (lora_decode.apply_group,
    the same bits as a module at a time). `plan()` gives the rows' plan (made on first use);
    a module no held adapter targets is left as it is."""
    mine = [i for i, k in enumerate(keys) if k in stack.A]
    if mine:
        from .kernels import lora_decode  # triton: only where the kernels run

        lora_decode.apply_group(plan(), x.reshape(-1, x.shape[-1]),
                                [stack.A[keys[i]] for i in mine],
                                [stack.B[keys[i]] for i in mine],
                                [ys[i].view(-1, ys[i].shape[-1]) for i in mine],
                                stack.rank_block)
    return list(ys)


def row_lora(stack: AdapterStack, adapters: list[Adapter | None],
             kernels: bool) -> RowLora | KernelRowLora:
    """The LoRA of rows that use `adapters` (None: the base model), built on the host."""
    if not kernels:
        masks = torch.stack([stack.mask_row(a) for a in adapters]).to(stack.device)
        return RowLora(stack, masks)
    start, rank, scale = zip(*(stack.row(a) for a in adapters), strict=True)
    dev = stack.device
    return KernelRowLora(stack, torch.tensor(start, dtype=torch.int32, device=dev),
                         torch.tensor(rank, dtype=torch.int32, device=dev),
                         torch.tensor(scale, dtype=torch.float32, device=dev))


class RowBuffers:
    """The LoRA inputs of a decode step's slots, in fixed device buffers: a mask row per
    slot (masked path) or a slot's (start, rank, scale) (kernels). Slots with nothing
    seated are the base model."""

    def __init__(self, stack: AdapterStack, rows: int, kernels: bool):
        self.stack, self.kernels = stack, kernels
        dev = stack.device
        if kernels:
            self.bufs = [torch.zeros(rows, dtype=torch.int32, device=dev),
                         torch.zeros(rows, dtype=torch.int32, device=dev),
                         torch.zeros(rows, dtype=torch.float32, device=dev)]
        else:
            self.bufs = [torch.zeros((rows, stack.width), dtype=stack.dtype, device=dev)]
        self._width = stack.width

    def set(self, first: int, adapters: list[Adapter | None]) -> None:
        """Slots first, first + 1, ... take `adapters`' rows: one copy per buffer."""
        if not adapters:
            return
        end = first + len(adapters)
        if not self.kernels:
            masks = {id(a): self.stack.mask_row(a) for a in adapters}  # one per adapter
            self.bufs[0][first:end] = torch.stack([masks[id(a)] for a in adapters]).to(
                self.stack.device)
            return
        start, rank, scale = zip(*(self.stack.row(a) for a in adapters), strict=True)
        for buf, vals in zip(self.bufs, (start, rank, scale), strict=True):
            buf[first:end] = torch.tensor(vals, dtype=buf.dtype).to(buf.device)

    def move(self, src: int, dst: int) -> None:
        for buf in self.bufs:
            buf[dst] = buf[src]
            buf[src] = 0

    def clear(self, i: int) -> None:
        for buf in self.bufs:
            buf[i] = 0

    def follow(self) -> None:
        """The stack grew: widen the masks (columns keep their places, and so do the
        kernels' starts)."""
        if self.kernels or self._width == self.stack.width:
            return
        old = self.bufs[0]
        mask = torch.zeros((old.shape[0], self.stack.width), dtype=old.dtype, device=old.device)
        mask[:, :old.shape[1]] = old
        self.bufs[0], self._width = mask, self.stack.width

    def lora(self, rows: int) -> RowLora | KernelRowLora:
        """The LoRA of slots 0..rows-1."""
        if self.kernels:
            return KernelRowLora(self.stack, *(b[:rows] for b in self.bufs))
        return RowLora(self.stack, self.bufs[0][:rows])
