"""One decode step of a running batch, from per-slot input buffers; CUDA graphs per bucket.

Running row i sits in slot i (slots 0..n-1 are the live rows, compacted). Its inputs live
in fixed device buffers: the token to feed, its position (= the KV length before it), its
block table and its LoRA inputs (lora_rows.RowBuffers: a mask row, or with `kernels` its
adapter's columns and scale). Everything else (slots to write, slots to read, the
attention mask) is computed from them inside the step, so the step is a pure function of
the buffers and can be captured as a CUDA graph.

Graphs are keyed by (rows, pages): rows rounded up to a power of two (1, 2, 4, ... up to
the buffers' row count) and pages per row (the attended length) to 1, 2, 3, 4, 6, 8, 12, ...
(a power of two or 1.5 times one: every slot attends over at most a third more than it
needs, and a row's whole life uses few buckets). A bucket's graph
is captured the first time it is needed and replayed by every later step and every later
`sample` call; slots past n in a bucket are inert (they feed token 0 at position 0 from
page 0 with no adapter, and their outputs are ignored). On CPU the same function runs
eagerly at the exact size ("eager"); "buckets" runs it eagerly at the graphs' sizes, so
CPU tests see what the padding slots of a graph do.

Cascade (`cascade`, with `kernels`): the samples of one request share their prompt's full
pages, and each sample's row reading them again moved a fan-out's prompt KV G times a step
(32 prompts x 8 samples of 512 + 256 tokens on the 8B: ~24 GB of KV a step where ~7 GB
hold it). `set_slots` takes each row's group (its request) and shared tokens into two more
slot buffers; every step derives the groups' chunks from them on the device
(paged_decode.prefix_groups, once a step, not per layer) and the attention reads each
chunk's prefix once per kv head (paged_decode._prefix_kernel). Rows leaving a group need
nothing: a group is whatever rows still carry its id. While no seated row shares a prefix
(a wide workload) the step runs the graphs without the prefix kernel, keyed apart
(the host keeps which slots share; it never reads the device). One H200, the 8B, that
fan-out: 23.0 -> 20.8 ms a decode step (kernels/paged_decode.py has the details); the wide
workload (256 x 1) never takes the cascade graphs (24.1 ms a step either way).
Without the kernels (`cascade` on, the default on CPU in eager mode, fp32) the grouping runs
in torch, shared_decode.py, from a host plan of the slots' groups (never in a graph).
"""

from __future__ import annotations

import torch

from .kv_pages import PagePool
from .lora_rows import AdapterStack, RowBuffers
from .moe import ExpertRows, run_tokens
from .recurrent import PromptState, SlotStates


def bucket(n: int, cap: int, fine: bool = False) -> int:
    """n rounded up to a power of two (`fine`: or 1.5 times one), at most `cap`."""
    b = 1
    while b < n:
        if fine and b >= 2 and b * 3 // 2 >= n:
            return min(b * 3 // 2, cap)
        b *= 2
    return min(b, cap)


class DecodeStep:
    MODES = ("eager", "buckets", "graphs")

    def __init__(self, model, pool: PagePool, stack: AdapterStack, rows: int, max_pages: int,
                 mode: str, kernels: bool = False, cascade: bool | None = False):
        if mode not in self.MODES:
            raise ValueError(f"decode mode must be one of {self.MODES}, got {mode!r}")
        dev = model.device
        if cascade is None:  # the kernels' where they run, else torch's on CPU, eagerly, in
            # fp32 (in bf16 the gather's SDPA rounds as the trainer's does, the two parts'
            # merge does not: sampler/trainer gap 0.0030 -> 0.0060 nats, test_logprob_gap)
            cascade = kernels or (mode == "eager" and dev.type == "cpu"
                                  and model.dtype == torch.float32)
        if cascade and not kernels and (mode == "graphs" or dev.type != "cpu"):
            raise ValueError("cascade attention needs the paged kernel (kernels=True) "
                             "but on CPU in eager or buckets mode (shared_decode.py)")
        self.model, self.pool, self.stack = model, pool, stack
        self.rows, self.max_pages = rows, max_pages
        self.tok = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)
        self.table = torch.zeros((rows, max_pages), dtype=torch.long, device=dev)
        self.group = torch.zeros(rows, dtype=torch.long, device=dev)  # a row's request
        self.shared = torch.zeros(rows, dtype=torch.long, device=dev)  # its shared tokens
        # A VL model's rotary offset per slot: after an image the rotary position of a token
        # is its KV index + delta (vision_prefill.py). None: text models (position = index).
        self.delta = (torch.zeros(rows, dtype=torch.long, device=dev)
                      if getattr(model, "vision", None) is not None else None)
        # Host mirrors of `group` and `shared` (which slots share picks the graph; the
        # torch cascade plans from them), and a count of slot changes (`_plan`).
        self._groups, self._sharing = [0] * rows, [0] * rows
        self._layout, self._shared_plan = 0, None
        self.lora = RowBuffers(stack, rows, kernels)
        self.adapters: list = [None] * rows  # each slot's adapter, on the host (MoE experts)
        # Linear-attention states per slot (Qwen3.5, recurrent.py): updated in place by
        # each step, so only eager steps run them (a graph's warm-up would step twice).
        self.states = SlotStates(model, rows) if model.hybrid is not None else None
        self.mode = mode
        self.kernels = kernels  # attention by the paged kernel (kv_pages.PagedView.attend)
        self.cascade = cascade  # shared prefixes read once per group (the module's doc)
        self._chunk = 1
        if cascade:
            from .kernels.paged_decode import members

            self._chunk = members(model.n_heads, model.n_kv)
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._version = stack.version
        self._mempool = torch.cuda.graph_pool_handle() if mode == "graphs" else None

    # -- the slots ------------------------------------------------------------------------

    def set_slots(self, first: int, tokens: list[int], pos: list[int], tables: list[list[int]],
                  adapters: list, groups: list[int] | None = None,
                  shared: list[int] | None = None,
                  prompts: list[PromptState] | None = None,
                  deltas: list[int] | None = None) -> None:
        """Seat rows in slots first, first + 1, ...: built on the host, one copy per buffer
        (a row at a time, seating 256 rows cost thousands of tiny copies). `groups`: each
        row's group id (>= 0; its request), `shared`: the tokens its first pages hold in
        common with the group's other rows (whole pages; 0: none). Cascade only.
        `prompts`: each row's prompt state (linear attention), copied into its slot.
        `deltas`: each row's rotary offset (a VL model's; None: 0)."""
        self._follow_stack()
        n = len(tokens)
        if n == 0:
            return
        table = torch.zeros((n, self.max_pages), dtype=torch.long)
        for i, pages in enumerate(tables):
            table[i, :len(pages)] = torch.tensor(pages)
        end = first + n
        self.tok[first:end] = torch.tensor(tokens).to(self.tok.device)
        self.pos[first:end] = torch.tensor(pos).to(self.pos.device)
        self.table[first:end] = table.to(self.table.device)
        if self.delta is not None:
            self.delta[first:end] = torch.tensor(deltas or [0] * n).to(self.delta.device)
        self.lora.set(first, adapters)
        self.adapters[first:end] = adapters
        if self.states is not None:
            self.states.seat(first, prompts)
        self._layout += 1
        if self.cascade:
            shared, groups = shared or [0] * n, groups or [0] * n
            self.group[first:end] = torch.tensor(groups).to(self.group.device)
            self.shared[first:end] = torch.tensor(shared).to(self.shared.device)
            self._sharing[first:end], self._groups[first:end] = shared, groups

    def move_slot(self, src: int, dst: int) -> None:
        """Slot `src`'s inputs into `dst`, and `src` made inert."""
        for buf in self._buffers():
            buf[dst] = buf[src]
            buf[src] = 0
        self._sharing[dst], self._sharing[src] = self._sharing[src], 0
        self._groups[dst], self._groups[src] = self._groups[src], 0
        self._layout += 1
        self.adapters[dst], self.adapters[src] = self.adapters[src], None
        self.lora.move(src, dst)
        if self.states is not None:
            self.states.move(src, dst)

    def clear_slot(self, i: int) -> None:
        for buf in self._buffers():
            buf[i] = 0
        self._sharing[i], self._groups[i] = 0, 0
        self._layout += 1
        self.adapters[i] = None
        self.lora.clear(i)
        if self.states is not None:
            self.states.clear(i)

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return (self.tok, self.pos, self.table) + ((self.group, self.shared)
                                                   if self.cascade else ()) + (
            (self.delta,) if self.delta is not None else ())

    def advance(self, n: int, tokens: torch.Tensor) -> None:
        """Live slots 0..n-1 feed `tokens` next, one position further on."""
        self.tok[:n] = tokens
        self.pos[:n] += 1

    def feed(self, n: int, tokens: torch.Tensor) -> None:
        """Live slots 0..n-1 feed `tokens` next instead, at the same positions (a step
        launched ahead redrew some rows' tokens: decode_loop.py)."""
        self.tok[:n] = tokens

    def count_graphs(self) -> int:
        return len(self._graphs)

    # -- the step -------------------------------------------------------------------------

    @torch.no_grad()
    def __call__(self, n: int, pages: int) -> torch.Tensor:
        """Next-token logits [n, vocab] of live slots 0..n-1, which attend over at most
        `pages` pages each."""
        self._follow_stack()
        cascade = self.cascade and any(self._sharing[:n])
        if self.mode == "eager":
            return self._run(n, pages, cascade)
        key = (bucket(n, self.rows), bucket(pages, self.max_pages, fine=True), cascade)
        if self.mode == "buckets":
            return self._run(*key)[:n]
        got = self._graphs.get(key)
        if got is None:
            got = self._graphs[key] = self._capture(*key)
        got[0].replay()
        return got[1][:n]

    def _run(self, rows: int, pages: int, cascade: bool = False) -> torch.Tensor:
        pos = self.pos[:rows]
        table = self.table[:rows, :pages]
        size = self.pool.page_size
        write = table.gather(1, (pos // size)[:, None])[:, 0] * size + pos % size
        keys = torch.arange(pages * size, device=pos.device)
        mask = (keys[None, :] <= pos[:, None])[:, None, None, :]
        lora = self.lora.lora(rows)
        if self.model.moe:  # the experts' LoRA reads each slot's adapter's bank (moe.py)
            lora = ExpertRows(lora, run_tokens([(a, 1) for a in self.adapters[:rows]],
                                               self.model.dtype, pos.device))
        prefix = shared = None
        if cascade and self.kernels:
            from .kernels.paged_decode import prefix_groups

            prefix = prefix_groups(self.group[:rows], self.shared[:rows], self._chunk)
        elif cascade:  # (None: no two rows share)
            plan = self._plan(rows)
            shared = plan and plan.at(table, pos, size)
        view = self.pool.view(write, table, pos + 1 if self.kernels else None,
                              prefix, None if self.states is None else self.states.bound(rows),
                              shared)
        rope = pos if self.delta is None else pos + self.delta[:rows]
        hidden = self.model.forward(self.tok[:rows, None], rope[:, None], lora, view, mask)
        return self.model.logits(hidden, lora)[:, 0]

    def _capture(self, rows: int, pages: int, cascade: bool
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up outside capture, as CUDA graphs need. It writes the live rows' keys at
        # their positions, as the replay will again: the same values.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(rows, pages, cascade)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            out = self._run(rows, pages, cascade)
        return graph, out

    def _plan(self, rows: int):
        """The torch cascade's plan of slots 0..rows-1 (shared_decode.plan), kept until a
        slot changes."""
        from . import shared_decode

        key = (self._layout, rows)
        if self._shared_plan is None or self._shared_plan[0] != key:
            self._shared_plan = (key, shared_decode.plan(
                self._groups[:rows], self._sharing[:rows], self.pool.page_size,
                self.pos.device))
        return self._shared_plan[1]

    def _follow_stack(self) -> None:
        """The adapter stack grew (or its rank block did): the LoRA buffers follow; the
        graphs read the old buffers, so they go."""
        if self._version == self.stack.version:
            return
        self.lora.follow()
        self._graphs.clear()
        if self._mempool is not None:
            # Freeing every graph of a private pool frees the pool; capturing into its old
            # id again trips the allocator's use_count assert (torch 2.13): a fresh pool.
            self._mempool = torch.cuda.graph_pool_handle()
        self._version = self.stack.version
