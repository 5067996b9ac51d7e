"""The multi-LoRA layer: many adapters, one base model, one pass.

Adapters of the same rank and target set live side by side in a *bank*: for every target
module the bank holds A [slots, r, in] and B [slots, out, r] (fp32 master weights), their
gradient buffers, and the AdamW moments. A batch row names its adapter's slot, so a
module's delta for a mixed batch is one gather and two batched matmuls, whatever the
number of adapters; rows with no adapter get none.

Gradients are written straight into the bank's buffers by the layer's backward (one
index_add per weight), rather than through autograd leaves: a leaf per adapter per module
would cost a gradient kernel per adapter per module, which dominates small steps.

Direct paths (`DIRECT`) skip the gathers where the bank already holds the rows' weights in
order: a group of one adapter (a lone tenant) runs plain matmuls on its slot, a group of
distinct adapters in consecutive slots reads and accumulates into a slice of the bank
(lora_fused.py). A small step is bound by the host's kernel launches: these paths issue
about half the LoRA ops of the gathered one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from twinkled.protocol.checks import check_optimizer
from twinkled.protocol.types import EXPERT_MODULES, EngineInputError, LoraConfig

from .chunked_logprobs import Segment, segment
from .lora_bank import Bank
from .lora_fused import SharedDelta, _LoraDelta, lone_deltas, shared_delta

# Direct paths, on views of the bank instead of each row's gathered copy: rows (or packed
# tokens) that all use one adapter take plain matmuls on its slot (lora_fused.lone_deltas);
# rows of distinct adapters in consecutive slots (8 tenants x 1 row) read a slice of the
# bank and add their gradients to it, without gathers or index_add. False: the gathered
# path for every group (the reference; tests compare the two).
DIRECT = True


@dataclass
class Adapter:
    id: str
    config: LoraConfig
    bank: Bank
    slot: int
    steps: int = 0  # optimizer steps taken
    pending: int = 0  # datums whose gradients wait for the next optimizer step
    counters: list = field(default_factory=list)  # AdamW's step counter (one tensor)

    @property
    def scale(self) -> float:
        return self.config.scale

    @property
    def version(self) -> int:
        """Its weights' version: changes at every write (optimizer step, load, copy)."""
        return self.bank.versions[self.slot]


class LoraPool:
    """Adds, finds and removes adapters; the base model's weights are never touched."""

    def __init__(self, targets: dict[str, tuple[int, int]], max_rank: int, device,
                 dtype: torch.dtype = torch.float32, shard=None,
                 bank_max_bytes: int | None = None):
        # targets: every module the model can adapt, "model.layers.0.self_attn.q_proj" ->
        # (in, out); the suffix (q_proj ...) is what a LoraConfig selects.
        self.targets = targets
        # Under tensor parallelism (tp.py: ShardPlan) banks hold this rank's slices.
        self.shard = shard
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        # The bytes this rank's adapters may take (the daemon's adapter budget): no bank
        # grows past them (lora_bank.py: Bank's max_bytes). None: no cap.
        self.bank_max_bytes = bank_max_bytes
        self.banks: dict[tuple, Bank] = {}
        self.adapters: dict[str, Adapter] = {}
        # Called with a bank that a new adapter would grow past the budget (no free slot,
        # every slot the budget holds made): the worker's samplers make room there
        # (workers/sampling.py, SampleRunner.give_room). None: the bank grows.
        self.at_budget: Callable[[Bank], None] | None = None

    def add(self, adapter_id: str, config: LoraConfig, init: bool = True) -> Adapter:
        """A new adapter in a bank slot; `init` False leaves its weights zero, for a caller
        that writes them at once (a load, a copy, an unpark): drawing A on the CPU and
        copying it in cost an unpark of the 0.5B most of its 70 ms, for nothing."""
        if adapter_id in self.adapters:
            raise EngineInputError("adapter_id", f"adapter {adapter_id!r} already exists")
        if not isinstance(config.rank, int) or not 1 <= config.rank <= self.max_rank:
            raise EngineInputError("rank", f"must be an integer in 1..{self.max_rank}, got {config.rank!r}")
        if not config.target_modules:
            raise EngineInputError("train_attn/train_mlp/train_unembed", "at least one must be true")
        if not (config.alpha > 0):
            raise EngineInputError("alpha", f"must be positive, got {config.alpha!r}")
        check_optimizer(config.optimizer)
        keys = self._keys(config)
        bank_key = (config.rank, tuple(sorted(keys)))
        bank = self.banks.get(bank_key)
        if bank is None:
            bank = self.banks[bank_key] = Bank(config.rank, keys, self.device, self.dtype,
                                               max_bytes=self.bank_max_bytes)
        if not bank.free and bank.at_cap() and self.at_budget is not None:
            self.at_budget(bank)
        slot = bank.allocate()
        if init:
            self._init_weights(bank, slot, config.seed)
        adapter = Adapter(adapter_id, config, bank, slot)
        self.adapters[adapter_id] = adapter
        return adapter

    def _keys(self, config: LoraConfig) -> dict[str, tuple[int, ...]]:
        """The modules an adapter of `config` trains, with their (local) shapes."""
        modules = config.target_modules + (EXPERT_MODULES if config.train_mlp else ())
        return {k: s if self.shard is None else self.shard.local_shape(k, s)
                for k, s in self.targets.items() if k.rsplit(".", 1)[-1] in modules}

    def bank_of(self, adapter_id: str) -> Bank:
        return self.get(adapter_id).bank

    def has_slot(self, config: LoraConfig) -> bool:
        """Whether adding an adapter of `config` takes a free slot of a bank that exists
        (grows no buffer: safe between two micro-batches of a step in flight)."""
        bank = self.banks.get((config.rank, tuple(sorted(self._keys(config)))))
        return bank is not None and bool(bank.free)

    @torch.no_grad()
    def _init_weights(self, bank: Bank, slot: int, seed: int | None) -> None:
        # As peft does: A ~ kaiming-uniform(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)); B = 0.
        # Drawn on the CPU so a seed gives the same adapter on every device (and, drawn
        # whole then sliced, under any tensor-parallel split). Unseeded, the ranks of a
        # tensor-parallel group must still agree: the engine passes a shared seed then.
        gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
        for key in bank.shapes:
            fin, _, *experts = self.targets[key]
            bound = 1.0 / fin**0.5
            a = torch.empty((*experts, bank.rank, fin)).uniform_(-bound, bound, generator=gen)
            if self.shard is not None:
                a = self.shard.local_lora(key, "A", a)
            bank.A[key][slot].copy_(a)
            bank.B[key][slot].zero_()
        bank.changed(slot)

    def get(self, adapter_id: str) -> Adapter:
        try:
            return self.adapters[adapter_id]
        except KeyError:
            raise EngineInputError("adapter_id", f"no adapter {adapter_id!r}") from None

    def remove(self, adapter_id: str) -> None:
        adapter = self.adapters.pop(adapter_id, None)
        if adapter is None:
            raise EngineInputError("adapter_id", f"no adapter {adapter_id!r}")
        adapter.bank.release(adapter.slot)
        # A bank with no adapters left frees its memory.
        if len(adapter.bank.free) == adapter.bank.capacity:
            self.banks = {k: b for k, b in self.banks.items() if b is not adapter.bank}


@dataclass
class _Group:
    start: int
    end: int
    bank: Bank
    slots: torch.Tensor  # [n] slot of each row
    scale: torch.Tensor  # [n, 1, 1]
    adapters: list[Adapter]  # each row's, on the host
    lone: Adapter | None = None  # every row's, where they all use one (and DIRECT)
    run: slice | None = None  # the slots, where distinct and consecutive (and DIRECT)


class LoraBatch:
    """Which adapter each row of a batch uses. Rows of one bank must be contiguous.

    `apply(key, x, y)` adds the adapters' deltas of module `key` to its base output y.
    With `cache=True` (sampling) the gathered weights are kept across decode steps.
    """

    def __init__(self, row_adapters: list[Adapter | None], dtype, device, cache: bool = False,
                 direct: bool | None = None):
        direct = DIRECT if direct is None else direct
        self.groups: list[_Group] = []
        self.n_rows = len(row_adapters)
        self.dtype = dtype  # the banks' compute dtype (Bank.dtype): no casts
        # Gathered weights: for one module call (q/k/v read each B twice), or with `cache`
        # for every decode step of a sampling batch (the LoraBatch lives as long as it).
        self.caching = cache
        self._memo: dict = {}
        # Autograd records an op only if an input requires grad; the bank tensors do not, so
        # this anchor makes every delta part of the graph even where x has no grad yet.
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        i = 0
        while i < len(row_adapters):
            ad = row_adapters[i]
            j = i + 1
            while j < len(row_adapters) and same_bank(row_adapters[j], ad):
                j += 1
            if ad is not None:
                rows = row_adapters[i:j]
                slots = torch.tensor([a.slot for a in rows], device=device)
                scale = torch.tensor([a.scale for a in rows], dtype=dtype, device=device)
                one = direct and all(a is ad for a in rows)
                first = rows[0].slot
                run = direct and [a.slot for a in rows] == list(range(first, first + len(rows)))
                self.groups.append(_Group(i, j, ad.bank, slots, scale.view(-1, 1, 1), rows,
                                          ad if one else None,
                                          slice(first, first + len(rows)) if run else None))
            i = j
        seen = [id(g.bank) for g in self.groups]
        if len(seen) != len(set(seen)):
            raise ValueError("rows of one bank must be contiguous")
        for g in self.groups:
            g.bank.refresh()

    def _gathered(self, what: tuple, g: _Group, make) -> torch.Tensor:
        """Each row's copy of some weights, gathered once per batch (and kept across
        decode steps with `cache`)."""
        key = (what, g.start)
        w = self._memo.get(key)
        if w is None:
            w = self._memo[key] = make()
        return w

    def _weights(self, key: str, g: _Group):
        if g.run is not None:  # the rows' own slots, in order: views
            return self._run_views(g, key)[:2]
        return (self._gathered(("A", key), g, lambda: g.bank.A16[key].index_select(0, g.slots)),
                self._gathered(("B", key), g, lambda: g.bank.B16[key].index_select(0, g.slots)))

    @staticmethod
    def _run_views(g: _Group, key: str | tuple[str, ...]):
        """A, B, gA, gB of `key` at the group's run of slots (a tuple of keys: their
        stacked A's and A gradients, or None), as views made once (Bank.cached)."""
        run, bank = g.run, g.bank

        def make():
            grads = bank.scratch()  # the backward adds in one kernel there (accumulate)
            if isinstance(key, tuple):
                A, gA = bank.stacked("w16", key), bank.stacked(grads, key)
                return None if A is None else (A[run], None, gA[run], None)
            return (bank.A16[key][run], bank.B16[key][run], bank.part(grads, "A", key)[run],
                    bank.part(grads, "B", key)[run])

        return bank.cached(("run", run.start, run.stop, key), make)

    def _grads(self, g: _Group, keys: list[str]):
        """Where a group's backward adds its gradients (lora_fused.accumulate): (rows,
        the A's stacked or None, (gA, gB) of each key); rows None where the buffers are
        already the rows' own slices."""
        if g.run is None:
            return (g.slots, g.bank.stacked("g", tuple(keys)),
                    [(g.bank.gA[k], g.bank.gB[k]) for k in keys])
        for slot in range(g.run.start, g.run.stop):
            g.bank.mark(slot)
        stack = self._run_views(g, tuple(keys)) if len(keys) > 1 else None
        return (None, None if stack is None else stack[2],
                [self._run_views(g, k)[2:] for k in keys])

    def _stacked(self, keys: list[str], g: _Group) -> torch.Tensor:
        """The A's of `keys` side by side: [rows, len(keys) * r, in]; one gather where
        they sit side by side in the bank (Bank.stacked)."""
        def make():
            if g.run is not None:
                stack = self._run_views(g, tuple(keys))
                if stack is not None:
                    return stack[0]
            stack = g.bank.stacked("w16", tuple(keys))
            if stack is not None:
                return stack.index_select(0, g.slots)
            return torch.cat([self._weights(k, g)[0] for k in keys], 1)

        return self._gathered(("A", tuple(keys)), g, make)

    def apply(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.apply_shared((key,), x, [y])[0]

    def apply_shared(self, keys: tuple[str, ...], x: torch.Tensor,
                     ys: list[torch.Tensor]) -> list[torch.Tensor]:
        """`apply` for modules that read the same x (q/k/v; gate/up), each key's delta
        added to its y: a bank's A's of the group run as one matmul (lora_fused.py)."""
        if not self.caching:  # a forward without grad keeps no layer's gathers
            self._memo = {}
        ys = list(ys)
        for g in self.groups:
            mine = [i for i, k in enumerate(keys) if k in g.bank.shapes]
            if not mine:
                continue
            whole = g.start == 0 and g.end == self.n_rows
            xs = x if whole else x[g.start:g.end]
            base = [ys[i] for i in mine] if whole else None
            mine_keys = [keys[i] for i in mine]
            if g.lone is not None:  # one adapter on every row: plain matmuls, no gathers
                ds = self._lone_deltas(g.lone, mine_keys, xs, base)
            else:
                ds = self._gathered_deltas(g, mine_keys, xs, base)
            for i, d in zip(mine, ds, strict=True):
                if whole:
                    ys[i] = d  # the base output and its delta
                else:
                    ys[i][g.start:g.end] += d  # y is the base linear's fresh output, not a view
        return ys

    def _lone_deltas(self, a: Adapter, keys: list[str], x: torch.Tensor,
                     ys: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """The deltas of rows that all use adapter `a` (lora_fused.lone_deltas): added to
        `ys` if given."""
        return lone_deltas(a.bank, a.slot, a.scale, tuple(keys), x, ys, self.anchor)

    def _gathered_deltas(self, g: _Group, keys: list[str], x: torch.Tensor,
                         ys: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """The deltas of a group of several adapters, from each row's weights (gathered,
        or views where its slots run in order): added to `ys` if given."""
        if len(keys) == 1:
            key = keys[0]
            A_rows, B_rows = self._weights(key, g)
            if torch.is_grad_enabled():
                rows, _, [(gA, gB)] = self._grads(g, keys)
                return [_LoraDelta.apply(x, self.anchor, A_rows, B_rows, gA, gB, rows,
                                         g.scale, *(ys or ()))]
            # sampling and forward-only: the same math without autograd's overhead
            d = torch.bmm(torch.bmm(x, A_rows.transpose(1, 2)) * g.scale,
                          B_rows.transpose(1, 2))
            return [d if ys is None else ys[0] + d]
        A = self._stacked(keys, g)
        Bs = [self._weights(k, g)[1] for k in keys]
        if torch.is_grad_enabled():
            rows, *grads = self._grads(g, keys)
            return list(SharedDelta.apply(x, self.anchor, A, rows, g.scale, tuple(grads),
                                          tuple(Bs), *(ys or ())))
        ds = shared_delta(x, A, g.scale, Bs)
        return ds if ys is None else [y + d for y, d in zip(ys, ds, strict=True)]

    def segments(self, key: str, seq: int) -> list[Segment]:
        """Module `key`'s adapters over the flattened batch [rows x `seq` tokens]: one
        segment per run of rows of one adapter."""
        out: list[Segment] = []
        for g in self.groups:
            if key not in g.bank.shapes:
                continue
            i = g.start
            while i < g.end:
                j = i + 1
                while j < g.end and g.adapters[j - g.start] is g.adapters[i - g.start]:
                    j += 1
                a = g.adapters[i - g.start]
                out.append(segment(g.bank, a.slot, a.scale, key, i * seq, j * seq, self.dtype))
                i = j
        return out


def same_bank(a: Adapter | None, b: Adapter | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.bank is b.bank
