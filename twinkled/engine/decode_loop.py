"""The decode loop of a running batch: one step's tokens after another, synchronous or
overlapped with the next step's GPU work.

A decode step is `launch` (the host enqueues the GPU work: the step's graph, the choice of
each row's token (choose.py: `RowChoice.select`, the fused kernel on CUDA unless a row asks
for top-k logprobs), the token buffers moved on, one packed copy of tokens, logprobs and
top-k rows to pinned host memory) and `land` (the host waits for that copy,
then records every row's token, checks its stop rule and retires the rows that stopped).
Synchronous (`overlap=False`, the reference): launch, land. Overlapped: launch step t + 1
before landing step t, so the GPU runs t + 1 while the host lands t, and the GPU never
waits for the host between steps.

Measured (one H200, `bench/bench_sampling.py --device cuda --paths new --overlap on,off`,
8 adapters r=32, prompts of 512, 256 new tokens, random weights; code at 1cf2272):

| shape, workload | overlap on: tok/s a call, ms a step | off | host waited, on / off |
|---|---|---|---|
| 0.5B, fan-out 32 x 8, T=1 | 37,853, 6.27 ms | 34,981, 6.75 ms | 4.55 / 5.04 ms a step |
| 0.5B, wide 256 x 1, greedy | 28,049, 5.94 ms | 27,650, 6.33 ms | 4.51 / 5.09 ms |
| 8B, fan-out 32 x 8, T=1 | 10,258, 22.40 ms | 9,991, 22.96 ms | 20.14 / 21.07 ms |

So the 0.5B's steps are GPU-bound, not host-bound: the host waits 4.5 of each 6.3 ms for
the step's results even overlapped (its own work, launch and landing, is ~1.7 ms); the
~0.5 ms the overlap saves a step is what the GPU sat idle while the host landed a step.
What is left to gain is GPU work (the graph's ~1,000 small kernels a step, the sampling's
passes over [rows, vocab] fp32: choose.py skips, since, the ones that change nothing at
temperature 1, ~4 of ~17 on the fan-out, not measured on a card). Both loops sampled the same tokens in 256 of 256 fan-out
samples on each shape (the wide workload's differed in 49 of 256 greedy samples, from the
batches' make-up while prompts joined: fixed since, see below, not re-measured).

Step t + 1 is launched for the rows live before step t landed, so it is speculative for
the rows that stop at t; the results stay exactly those of the synchronous loop:
- The KV a stopped row writes at t + 1 lands in its own pages (a row holds pages for
  prompt + max_tokens positions and writes at most position prompt + max_tokens - 1), which
  are released after the launch, so whoever gets them writes after it (one CUDA stream).
- Its token is dropped. The others' tokens stand, with one exception: the rows of a seeded
  request draw together from its generator (choose.py), so if some of a request's rows
  stopped at t and others go on, the draw at t + 1 was for too many rows. The generator is
  put back as it was before that draw (a snapshot taken at launch, only for requests whose
  stop rule looks at tokens: a request's rows always have as many tokens, so max_tokens
  stops all of them at once) and its live rows draw again, from the same logits, as the
  synchronous loop would have drawn them. Greedy and unseeded rows keep their tokens.
- The rows left move down into the freed slots (`RunningBatch._vacate`); step t + 1's
  results follow them (one gather) before they land.
No step is launched ahead while waiting requests can join at the next step (or queued
prompts are still prefilling, prefill_queue.py), so they join
a settled batch beside the rows the synchronous loop has (the same batches: on a GPU a
batch's make-up can round bf16 logits differently). Rows that could not join until a
stop freed room land the step in flight first (`settle`): they join a settled batch, and
the adapter stack may grow (a graph in flight never loses its buffers); cancel needs no
settling (the cancelled rows are marked done and skipped when their step lands). A step
in flight outlives `RunningBatch.step` and slices: the next call lands it (an optimizer
step between slices changes nothing it reads: the running rows' adapter weights are
copies, lora_rows.AdapterStack).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .choose import RowChoice
from .decode_step import DecodeStep


@dataclass
class Flight:
    """A launched decode step whose results the host has not read."""

    layout: list  # the rows (running_seqs.Seq) of slots 0..n-1 at launch
    logits: torch.Tensor  # [n, vocab]: the step's output (valid until the next launch)
    tokens: torch.Tensor  # [n] the chosen tokens, on the device
    packed: torch.Tensor  # [n, 2 + 2k] float64: token, logprob, top-k ids, top-k logprobs
    snaps: list[tuple[torch.Generator, torch.Tensor]] = field(default_factory=list)
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None

    def send(self) -> None:
        """Start the one copy of the results to the host (pinned, not waited for)."""
        if self.packed.device.type != "cuda":
            self.host = self.packed
            return
        self.host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
        self.host.copy_(self.packed, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def read(self) -> tuple[list[int], list[float], tuple[list, list]]:
        """Tokens, logprobs and top-k (ids, logprobs) rows, once the copy is done."""
        if self.event is not None:
            self.event.synchronize()
        h, k = self.host, (self.host.shape[1] - 2) // 2
        top = (h[:, 2:2 + k].long().tolist(), h[:, 2 + k:].tolist()) if k else ([], [])
        return h[:, 0].long().tolist(), h[:, 1].tolist(), top


def pack(tokens: torch.Tensor, lps: torch.Tensor, logp: torch.Tensor | None, k: int
         ) -> torch.Tensor:
    """[n, 2 + 2k] float64 (exact for token ids and float32 logprobs): one copy to the host;
    `logp` is read only for k > 0."""
    cols = [tokens.double()[:, None], lps.double()[:, None]]
    if k:
        values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
        cols += [ids.double(), values.double()]
    return torch.cat(cols, 1)


class DecodeLoop:
    """Decode steps over the rows of a `RunningBatch` (`live`, in slot order). Callbacks:
    `choice_of(seqs)`, the RowChoice of `seqs` as if in slots 0..len - 1 (a request's rows
    drawing together); `retire(b, done)`, finish the row of slot `b` and free its slot."""

    def __init__(self, decode: DecodeStep, overlap: bool,
                 choice_of: Callable[[list], RowChoice],
                 retire: Callable[[int, list], None]):
        self.decode, self.overlap = decode, overlap
        self._choice_of, self._retire = choice_of, retire
        self._flight: Flight | None = None
        self._choice: tuple[RowChoice, int, list[torch.Generator]] | None = None
        self._top: int | None = None  # the furthest live row's position on the device
        self.waited = 0.0  # seconds the host waited for steps' results (bench_sampling.py)

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    def changed(self, live: list) -> None:
        """Rows joined or left the batch other than by stopping (admission, cancel); an
        empty batch keeps no step in flight (landing it records nothing: rows cancelled)."""
        self._choice, self._top = None, None
        if not live:
            self.settle(live, [])

    def step(self, live: list, done: list, land: bool = True, ahead: bool = True) -> None:
        """Land one decode step (recording each live row's token), having launched the
        next one first when overlapped and `ahead`; `land=False` (after `settle`): only
        launch it."""
        if not self.overlap:
            self._land(self._launch(live), None, live, done)
        elif not land:
            self._flight = self._launch(live)
        else:
            f = self._flight or self._launch(live)
            self._flight = None
            self._flight = self._land(f, self._launch(live) if ahead else None, live, done)

    def settle(self, live: list, done: list) -> bool:
        """Land the step in flight (launching none); whether there was one."""
        f, self._flight = self._flight, None
        if f is not None:
            self._land(f, None, live, done)
        return f is not None

    # -- one step -------------------------------------------------------------------------

    def _launch(self, live: list) -> Flight:
        n, pool = len(live), self.decode.pool
        if self._top is None:
            self._top = max(s.length for s in live)
        logits = self.decode(n, pool.pages_for(self._top + 1))
        self._top += 1
        for s in live:  # (s.length: the positions the device wrote or is writing)
            s.length += 1
        if self._choice is None:
            self._choice = self._rebuild(live)
        choice, k, split = self._choice
        snaps = [(g, g.get_state()) for g in split] if self.overlap else []
        tokens, lps, logp = choice.select(logits, k)
        self.decode.advance(n, tokens)
        f = Flight(list(live), logits, tokens, pack(tokens, lps, logp, k), snaps)
        f.send()
        return f

    def _rebuild(self, live: list) -> tuple[RowChoice, int, list[torch.Generator]]:
        """The rows' choice, their widest top-k, and the generators a stop may split."""
        k = max(s.request.req.topk_sample for s in live)
        split = {id(s.request): s.request.gen for s in live
                 if s.request.gen is not None and s.request.req.params.stop != []}
        return self._choice_of(live), k, list(split.values())

    def _land(self, f: Flight, g: Flight | None, live: list, done: list) -> Flight | None:
        """Record `f`'s tokens; retire the rows that stopped; `g` (launched after `f`, for
        the rows then live) follows the rows left: returned as they will land it."""
        t0 = time.perf_counter()
        tokens, lps, top = f.read()
        self.waited += time.perf_counter() - t0
        stopped = []
        for b, s in enumerate(f.layout):
            if s.done is None:  # (done: cancelled since the launch)
                s.record(tokens[b], lps[b], top, b)
                if s.done is not None:
                    stopped.append(s)
        if not stopped:
            return g
        slot = {id(s): b for b, s in enumerate(live)}
        for b in sorted((slot[id(s)] for s in stopped), reverse=True):
            self._retire(b, done)  # highest slot first: the row moved in has not stopped
        self._choice, self._top = None, None
        if g is None or not live:
            return None
        return self._follow(g, live, {id(s.request) for s in stopped})

    def _follow(self, g: Flight, live: list, stopped: set[int]) -> Flight:
        """`g`'s results for the rows left (in their new slots), the rows of a seeded
        request that lost rows drawing again from their generator's state before `g`."""
        where = {id(s): i for i, s in enumerate(g.layout)}
        old = [where[id(s)] for s in live]
        dev = g.tokens.device
        at = torch.tensor(old, device=dev)
        tokens, packed = g.tokens.index_select(0, at), g.packed.index_select(0, at)
        redo = [b for b, s in enumerate(live) if id(s.request) in stopped
                and s.request.gen is not None]
        if redo:
            gens = {id(s.request.gen) for s in (live[b] for b in redo)}
            for gen, state in g.snaps:
                if id(gen) in gens:
                    gen.set_state(state)
            seqs = [live[b] for b in redo]
            logits = g.logits.index_select(0, torch.tensor([old[b] for b in redo], device=dev))
            k = (g.packed.shape[1] - 2) // 2
            t, lp, logp = self._choice_of(seqs).select(logits, k)  # (as the launch chose)
            rows = torch.tensor(redo, device=dev)
            tokens[rows] = t
            packed[rows] = pack(t, lp, logp, k)
            self.decode.feed(len(live), tokens)
        f = Flight(list(live), g.logits, tokens, packed)
        f.send()
        return f
