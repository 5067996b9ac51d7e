"""Continuous batching for sampling: sequences join and leave the running batch at every step.

`RunningBatch.admit` queues requests; each `step` first admits waiting requests while rows
and KV pages allow (first come, first served), then runs one prefill pass of at most
`prefill_tokens` prompt tokens (prefill_queue.py: the admitted prompts packed end to end,
prefill.py, a long one cut into chunks over several steps), whose finished prompts choose
their first tokens and join, then one decode step for every running row. A row that
stops gives its pages and its slot back at once, so a waiting request joins at the next
step, a short request never waits for a long one beside it, and a long prompt does not
stall the rows decoding while it prefills.

Admission takes a request whole (running_admission.py): all its samples start together and
hold, from the start, the pages their longest possible continuation needs (prompt +
max_tokens), so a running row never waits for memory and nothing is ever preempted. A
request's samples, and identical (adapter, prompt) pairs admitted together, prefill once and
share the prompt's full pages (kv_pages.py); they stay cached for later prompts that start
alike (prefix_cache.py).

Rows of many adapters (and the base model) run in one step, each through its own LoRA
(lora_rows.py), with its own temperature, top-k, top-p, seed and stop rule (choose.py).
Seeded rows draw from their request's generator as the padded sampler does, so the same
seed gives the same tokens on both paths (while a request's rows run to the same length).
On CUDA a decode step is launched before the host records the last one (decode_loop.py).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

import torch

from twinkled.protocol.types import EngineInputError, SampledSequence, SampleRequest

from . import kernels as kern
from .choose import RowChoice, top_rows
from .decode_loop import DecodeLoop
from .decode_step import DecodeStep
from .kv_pages import PagePool
from .lora import Adapter
from .lora_rows import AdapterStack
from .prefill_queue import PrefillQueue, Ready
from .prefix_cache import PrefixCache, weights_key
from .prompt_scores import score_prompt, wants_scores
from .recurrent import SlotStates
from .running_admission import Admission
from .running_seqs import Finished, Request, Seq
from .step import HOST_TIME
from .vision_prefill import cache_key, rope_delta

PAGE_SIZE = 16  # tokens per KV page
KV_BYTES = {"cuda": 4 << 30, "cpu": 64 << 20}  # default page pool size per device type
PREFILL_TOKENS = {"cuda": 16384, "cpu": 2048}  # prompt tokens of one prefill pass (a step's)
PREFILLS = ("varlen", "padded")


def pool_pages(model, kv_bytes: int | None, page_size: int = PAGE_SIZE) -> int:
    """Pages of a KV pool of `kv_bytes` (None: the device's default) for `model`."""
    heads, k_dim, v_dim = model.kv_shape
    per_token = model.kv_layers * heads * (k_dim + v_dim) * model.dtype.itemsize
    kv_bytes = kv_bytes or KV_BYTES.get(model.device.type, KV_BYTES["cuda"])
    return max(2, kv_bytes // (per_token * page_size))


def pool_tokens(model, kv_bytes: int | None) -> int:
    """The longest sequence (prompt and new tokens) a pool of `kv_bytes` holds: all its
    pages but the reserved one."""
    return (pool_pages(model, kv_bytes) - 1) * PAGE_SIZE


class RunningBatch:
    """Up to `rows` sequences decoding together over a pool of `pages` KV pages (default:
    as many as `kv_bytes` hold, else `KV_BYTES` of the device type). `decode`: how a decode step runs (decode_step.py;
    default "graphs" on CUDA devices, else "eager"). `prefix_cache`: share of the pages cached
    prompts may hold. `kernels`: the Triton paths (decode attention straight from the pages,
    kernels/paged_decode.py; LoRA rows, kernels/lora_decode.py); None: where
    `kernels.available` (CUDA); True on CPU needs the interpreter (`kernels.runnable`);
    False keeps the reference paths (gather + SDPA, masked LoRA stack). `cascade`: samples read
    their shared prompt pages once a step (decode_step.py; None: with the kernels, and
    without them on CPU in eager mode, in torch: shared_decode.py).
    `overlap`: launch each decode step before the host records the previous one
    (decode_loop.py; default on CUDA devices); False: the synchronous loop, the reference.
    `prefill`: "varlen" (admitted prompts packed end to end, chunked: at most
    `prefill_tokens` prompt tokens a step, prefill_queue.py) or "padded" (the reference:
    admitted prompts right-padded into one pass, at most `prefill_tokens` padded tokens).
    None: varlen on CPUs, padded on GPUs until the varlen pass's GPU attention over keys
    already in the pages (a cached prefix, an earlier chunk) has run on a card
    (`bench_sampling.py --prefill padded,varlen` checks that both sample the same)."""

    def __init__(self, model, rows: int = 256, pages: int | None = None,
                 page_size: int = PAGE_SIZE, prefill_tokens: int | None = None,
                 decode: str | None = None, kv_bytes: int | None = None,
                 prefix_cache: float = 0.0, kernels: bool | None = None,
                 cascade: bool | None = None, overlap: bool | None = None,
                 prefill: str | None = None):
        dev = model.device
        if model.hybrid is not None:  # only the paths that carry a recurrent state (recurrent.py)
            prefill, decode, overlap, prefix_cache, cascade = "varlen", "eager", False, 0.0, False
        elif model.moe:  # no CUDA graph captures the routing (its pairs are data-dependent)
            decode = "eager"
        if model.tp.size > 1 and decode is None:  # a tensor-parallel group's collectives:
            decode, overlap = "eager", False  # eager, every rank in the same order (graphs
            # that capture them: on trial, bench_tp.py --sample)
        prefill = prefill or ("padded" if dev.type == "cuda" else "varlen")
        if prefill not in PREFILLS:
            raise ValueError(f"prefill must be one of {PREFILLS}, got {prefill!r}")
        if kernels is None:
            kernels = kern.available(dev)
        elif kernels and not kern.runnable(dev):
            raise ValueError(f"the Triton kernels cannot run on {dev} (CPU: TRITON_INTERPRET=1)")
        self.kernels = kernels
        kv_bytes = kv_bytes or KV_BYTES.get(dev.type, KV_BYTES["cuda"])
        if model.hybrid is not None:
            rows, kv_bytes = SlotStates.fit(model, rows, kv_bytes)
        if pages is None:
            pages = pool_pages(model, kv_bytes, page_size)
        self.model, self.rows = model, rows
        heads, k_dim, v_dim = model.kv_shape
        self.pool = PagePool(model.kv_layers, heads, k_dim, pages, page_size, model.dtype, dev,
                             v_dim, latent=model.latent is not None)
        self.stack = AdapterStack(model.dtype, dev)
        self.cache = PrefixCache(self.pool, prefix_cache)
        max_pages = min(self.pool.usable, self.pool.pages_for(model.max_seq_len))
        self.decode = DecodeStep(model, self.pool, self.stack, rows, max_pages,
                                 decode or ("graphs" if dev.type == "cuda" else "eager"), kernels,
                                 cascade)
        self.prefill_tokens = prefill_tokens or PREFILL_TOKENS.get(dev.type, 16384)
        self.prefilling = PrefillQueue(model, self.pool, self.stack, kernels,
                                       self.prefill_tokens, prefill == "varlen")
        self.admission = Admission(model, self.pool, self.cache, self.stack,
                                   self.prefill_tokens, padded=prefill != "varlen")
        self._seating = 0  # rows of the requests being prefilled (they have their pages)
        self.waiting: deque[Request] = deque()
        self.live: list[Seq] = []  # slot order
        self._started: dict[int, Request] = {}  # admitted and not finished, by ticket
        self._tickets = itertools.count()
        self.overlap = dev.type == "cuda" if overlap is None else overlap
        self.loop = DecodeLoop(self.decode, self.overlap, self._choice_of, self._retire)

    # -- public -----------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.live and not self.prefilling.pending

    @property
    def free_pages(self) -> int:
        return self.pool.free

    def fits(self, req: SampleRequest) -> bool:
        """Whether `req` could run in this batch when it is empty."""
        length = len(req.prompt) + req.params.max_tokens
        return (req.num_samples <= self.rows and self.admission.pages(req) <= self.pool.usable
                and self.pool.pages_for(length) <= self.decode.max_pages)

    def admit(self, requests: list[SampleRequest], adapters: list[Adapter | None]) -> list[int]:
        """Queue `requests` (adapters[i]: request i's, None: the base model); returns their
        tickets, which `step` names when they finish."""
        for r in requests:
            if not self.fits(r):
                raise EngineInputError(
                    "num_samples/max_tokens", f"{r.num_samples} samples of {len(r.prompt)} + "
                    f"{r.params.max_tokens} tokens do not fit the sampler's KV pool "
                    f"({self.pool.usable} pages of {self.pool.page_size}, {self.rows} rows)")
        new = [Request(next(self._tickets), r, a, self.model)
               for r, a in zip(requests, adapters, strict=True)]
        self.waiting.extend(new)
        return [r.ticket for r in new]

    def run(self, max_steps: int | None = None, max_seconds: float | None = None,
            until_done: bool = False, min_seconds: float = 0.0,
            stop: Callable[[], bool] | None = None) -> list[Finished]:
        """A decode slice: steps until the batch is idle, `max_steps` steps ran or
        `max_seconds` passed (checked between steps), or with `until_done` as soon as a
        request finished and `min_seconds` passed, or once `stop()` says so (asked between
        steps); returns the requests that finished."""
        done: list[Finished] = []
        start, steps = time.monotonic(), 0
        while not self.idle and (max_steps is None or steps < max_steps) and (
                max_seconds is None or time.monotonic() - start < max_seconds) and not (
                until_done and done and time.monotonic() - start >= min_seconds) and not (
                stop is not None and stop()):
            done += self.step()
            steps += 1
        return done

    def pieces(self) -> dict[int, list[list[int]]]:
        """Tokens generated since the last call, per running ticket and sample (streaming)."""
        return {t: [s.tokens for s in seqs] for t, seqs in self.partials().items()}

    def partials(self, tickets: list[int] | None = None) -> dict[int, list[SampledSequence]]:
        """What each running ticket's samples (of `tickets`, if given) generated since the
        last call (tokens, their logprobs and top-k rows; stop_reason ""): a stream's next
        piece. A request that finishes hands the rest out in its result."""
        out = {}
        for ticket in self._started if tickets is None else tickets:
            r = self._started.get(ticket)
            if r is None:  # not started yet, or finished
                continue
            out[ticket] = [SampledSequence(s.tokens[s.sent:], s.logprobs[s.sent:], "",
                                           None if s.top is None else
                                           (s.top[0][s.sent:], s.top[1][s.sent:]))
                           for s in r.seqs]
            for s in r.seqs:
                s.sent = len(s.tokens)
        return out

    @property
    def waiting_requests(self) -> int:
        """Admitted requests that wait for rows or pages (they start as others finish)."""
        return len(self.waiting)

    @property
    def waiting_rows(self) -> int:
        """The rows (samples) of the waiting requests."""
        return sum(r.req.num_samples for r in self.waiting)

    def cancel(self, ticket: int) -> bool:
        """Drop a queued or running request: its rows leave the batch at once and give
        their pages back. False if the ticket is neither (it finished, or never was)."""
        for r in self.waiting:
            if r.ticket == ticket:
                self.waiting.remove(r)
                return True
        r = self._started.pop(ticket, None)
        if r is None:
            return False
        r.cancelled = True  # (being prefilled: it goes when its prompt is ready)
        for b in reversed([b for b, s in enumerate(self.live) if s.request is r]):
            s = self.live[b]
            s.done = "cancelled"  # (a step in flight skips it when it lands)
            self._drop(s)
            self._vacate(b)
        self.loop.changed(self.live)
        return True

    @torch.no_grad()
    def step(self) -> list[Finished]:
        """Admit what fits, then one decode step; returns the requests that finished."""
        done: list[Finished] = []
        # Rows join a settled batch: landing the step in flight is this call's step.
        settled = self.loop.in_flight and self._joining() and self.loop.settle(
            self.live, done)
        self._admit_waiting()
        began = time.perf_counter()
        self._seat(self.prefilling.run(), done)  # one prefill pass (chunked)
        prefilled = time.perf_counter()
        if self.live:  # none ahead while rows wait to join next: they join as they would
            rows = len(self.live)
            self.loop.step(self.live, done, land=not settled, ahead=not self._joining())
            # (a trace's figures of a slice: how full its steps ran, where its time went)
            HOST_TIME.note(**{"decode steps": 1, "decode rows": rows,
                              "prefill s": prefilled - began,
                              "decode s": time.perf_counter() - prefilled})
        return done

    def sized_for(self, requests: list[SampleRequest]) -> RunningBatch:
        """This batch if every request fits it, else a new one, as large as they need."""
        if all(self.fits(r) for r in requests):
            return self
        rows = max([self.rows, *(r.num_samples for r in requests)])
        pages = max([self.pool.pages, *(self.admission.pages(r) + 1 for r in requests)])
        return RunningBatch(self.model, rows, pages, self.pool.page_size, self.prefill_tokens,
                            self.decode.mode, prefix_cache=self.cache.share,
                            kernels=self.kernels, cascade=self.decode.cascade,
                            overlap=self.overlap,
                            prefill="varlen" if self.prefilling.varlen else "padded")

    # -- admission and prefill ----------------------------------------------------------

    def _joining(self) -> bool:
        """Whether rows may join at this step (requests to admit, prompts to prefill)."""
        return self.prefilling.pending or bool(self._admission())

    def _admit_waiting(self) -> None:
        take = self._admission()
        for _ in take:
            self.waiting.popleft()
        if take:
            prompts = self.admission.queue(take)  # (their pages)
            for r in take:
                self._started[r.ticket] = r
                self._seating += r.req.num_samples
            self.prefilling.add(prompts)

    def _admission(self) -> list[Request]:
        """The waiting requests that join now (first come, first served, while they fit)."""
        return self.admission.take(self.waiting, self.rows - len(self.live) - self._seating)

    def _seat(self, ready: list[Ready], done: list[Finished]) -> None:
        """The samples of the prompts now prefilled: their pages settled, their first
        tokens chosen; the ones that go on join the batch."""
        pool, P = self.pool, self.pool.page_size
        seqs: list[Seq] = []
        rows: list[int] = []  # each sample's row of the prompts' logits
        for i, rd in enumerate(ready):
            p, n = rd.prompt, len(rd.prompt.prompt)
            full, holders, copies = n // P, 0, []  # copies: its partial page's
            for r in p.requests:
                self._seating -= r.req.num_samples
                if wants_scores(r.req):  # (its prefill started at 0)
                    ids = torch.tensor(p.prompt, device=self.model.device)
                    score_prompt(self.model, r.req, r.adapter, rd.hidden, ids, r.result)
                holders += len(r.seqs)
                copies += [s.pages[full] for s in r.seqs if n % P and s.pages[full] != p.pages[full]]
                if r.cancelled:
                    continue
                seqs += r.seqs
                rows += [i] * len(r.seqs)
            pool.copy_page(p.pages[full] if copies else 0, copies)  # (before `_drop`s)
            pool.share(p.pages[:full], holders - 1)  # the shared pages' holders are the samples
            self.cache.insert(cache_key(weights_key(self.stack, p.adapter), p.requests[0].req.images),
                              p.prompt, p.pages[:full])
            for r in p.requests:
                if r.cancelled:
                    for s in r.seqs:
                        self._drop(s)
        if not seqs:
            return
        choice = self._choice_of(seqs)
        logits = torch.stack([rd.logits for rd in ready])
        k = max(s.request.req.topk_sample for s in seqs)
        tokens, lps, logp = choice.select(logits.index_select(0, torch.tensor(rows, device=logits.device)), k)
        top = top_rows(logp, k)
        seated: list[Seq] = []
        for b, (s, tok, lp) in enumerate(zip(seqs, tokens.tolist(), lps.tolist(), strict=True)):
            s.record(tok, lp, top, b)
            if s.done is not None:
                self._finish(s, done)
            else:
                seated.append(s)
        shares = [(len(s.request.req.prompt), s.request.req.num_samples) for s in seated]
        prompt_of = {id(r): rd.prompt for rd in ready for r in rd.prompt.requests}
        self.decode.set_slots(len(self.live), [s.tokens[-1] for s in seated],
                              [s.length for s in seated], [s.pages for s in seated],
                              [s.request.adapter for s in seated],
                              [s.request.ticket for s in seated],  # its samples: a group
                              [n // P * P if m > 1 else 0 for n, m in shares],
                              [prompt_of[id(s.request)].state for s in seated],
                              [rope_delta(prompt_of[id(s.request)].vision) for s in seated])
        self.live += seated  # (shared: the prompt's full pages)
        self.loop.changed(self.live)

    # -- decoding -----------------------------------------------------------------------

    def _retire(self, b: int, done: list[Finished]) -> None:
        """The row of slot `b` stopped: it finishes and its slot is freed."""
        self._finish(self.live[b], done)
        self._vacate(b)

    def _vacate(self, b: int) -> None:
        """Free slot `b`: the last row moves into it (so free the highest slots first)."""
        live, last = self.live, len(self.live) - 1
        if b != last:
            self.decode.move_slot(last, b)
            live[b] = live[last]
        else:
            self.decode.clear_slot(b)
        live.pop()

    def _choice_of(self, seqs: list[Seq]) -> RowChoice:
        """Sampling parameters of `seqs` (in slots 0, 1, ...); a request's rows draw
        together, in sample order."""
        by_req: dict[int, tuple[Request, list[tuple[int, int]]]] = {}
        for slot, s in enumerate(seqs):
            if s.request.req.params.temperature > 0:
                r = s.request
                by_req.setdefault(r.ticket, (r, []))[1].append((s.index, slot))
        groups = [([slot for _, slot in sorted(idx)], r.gen) for r, idx in by_req.values()]
        return RowChoice.of([s.request.req.params for s in seqs], groups, self.model.device)

    def _drop(self, s: Seq) -> None:
        """`s` gives its pages and its adapter's columns back."""
        self.pool.release(s.pages)
        if s.request.adapter is not None:
            self.stack.release(s.request.adapter)

    def _finish(self, s: Seq, done: list[Finished]) -> None:
        self._drop(s)
        r = s.request
        r.running -= 1
        if r.running == 0:
            del self._started[r.ticket]
            r.result.sequences = [SampledSequence(x.tokens, x.logprobs, x.done or "length", x.top)
                                  for x in r.seqs]
            done.append(Finished(r.ticket, r.result))
