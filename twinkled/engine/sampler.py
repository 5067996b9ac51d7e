"""Batched generation for prompts of many adapters (and the base model) at once.

`generate` is a loop over a `RunningBatch` (running.py): continuous batching over a paged
KV cache, rows joining and leaving at every step. `generate_padded` is the earlier path,
kept as the reference the tests compare the running batch against: prompts are
left-padded into one batch with a preallocated KV cache and each decode step is one
forward of the whole batch (it waits for its longest row). On both, every row runs through
its own LoRA and token choice is vectorised over rows (choose.py); seeded requests draw
from their own generator, so the same seed gives the same output.
"""

from __future__ import annotations

import torch

from twinkled.protocol.types import SampledSequence, SampleRequest, SampleResult

from .choose import RowChoice, request_generator, stop_reason, top_rows
from .lora import Adapter, LoraBatch
from .model import BaseModel
from .prompt_scores import score_prompt, wants_scores
from .running import Finished, RunningBatch


@torch.no_grad()
def generate(model: BaseModel, requests: list[SampleRequest], adapters: list[Adapter | None],
             share_prefill: bool = True, batch: RunningBatch | None = None,
             others: list[Finished] | None = None) -> list[SampleResult]:
    """Sample every request; `adapters[i]` is request i's adapter (None: the base model).
    `batch`: the running batch to use (its CUDA graphs are kept across calls; by default a
    new one); requests it already runs go on beside these, and those that finish meanwhile
    are put in `others`. `share_prefill=False` runs the padded path with every row
    prefilled on its own (the reference the shared prefill is tested against)."""
    if not share_prefill:
        return generate_padded(model, requests, adapters, share_prefill=False)
    if batch is None:
        batch = RunningBatch(model)
    if not batch.idle and others is None:
        raise RuntimeError("the running batch is in use: pass `others` for its results")
    tickets = batch.admit(requests, adapters)
    mine = set(tickets)
    results: dict[int, SampleResult] = {}
    while len(results) < len(tickets):
        for f in batch.step():
            if f.ticket in mine:
                results[f.ticket] = f.result
            else:
                others.append(f)
    return [results[t] for t in tickets]


class _Row:
    def __init__(self, req: int, req_obj: SampleRequest, adapter: Adapter | None):
        self.req = req
        self.params = req_obj.params
        self.prompt = req_obj.prompt
        self.adapter = adapter
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: tuple[list[list[int]], list[list[float]]] | None = (
            ([], []) if req_obj.topk_sample else None)
        self.done: str | None = None  # stop reason once finished


@torch.no_grad()
def generate_padded(model: BaseModel, requests: list[SampleRequest],
                    adapters: list[Adapter | None], share_prefill: bool = True
                    ) -> list[SampleResult]:
    """The padded path: one left-padded batch that decodes until its longest row is done.
    `share_prefill=False` prefills every row on its own."""
    rows = [_Row(i, r, adapters[i]) for i, r in enumerate(requests) for _ in range(r.num_samples)]
    # Rows of one LoRA bank must sit together (LoraBatch); base-model rows go first.
    rows.sort(key=lambda r: (0, (), 0) if r.adapter is None else (1, r.adapter.bank.order, r.adapter.slot))
    dev = model.device
    B = len(rows)
    P = max(len(r.prompt) for r in rows)
    max_new = max(r.params.max_tokens for r in rows)
    T = P + max_new
    lora = LoraBatch([r.adapter for r in rows], model.dtype, dev, cache=True)
    cache = model.new_cache(B, T)

    # Prefill once per distinct (adapter, prompt): a request's num_samples copies, and
    # identical prompts of other requests, share it; only the continuations are per row.
    # `uniq` are the rows that prefill (in row order, so a bank's rows stay together);
    # `of[b]` is the prefilled row whose prompt row b copies.
    first: dict[tuple, int] = {}
    uniq: list[_Row] = []
    of: list[int] = []
    for b, r in enumerate(rows):
        key = ((None if r.adapter is None else r.adapter.id, tuple(r.prompt))
               if share_prefill else (b,))
        if key not in first:
            first[key] = len(uniq)
            uniq.append(r)
        of.append(first[key])
    U = len(uniq)

    # Left padding: every row's last prompt token sits at P-1, so all rows decode in step.
    pad = torch.tensor([P - len(r.prompt) for r in rows])
    ids = torch.zeros((U, P), dtype=torch.long)
    for u, r in enumerate(uniq):
        ids[u, P - len(r.prompt):] = torch.tensor(r.prompt)
    ids, pad = ids.to(dev), pad.to(dev)
    of_t = torch.tensor(of, device=dev)
    cols = torch.arange(T, device=dev)
    # Which cache positions a row may attend to: its prompt (not its padding) for now;
    # each decode step opens one more position.
    key_ok = (cols[None, :] >= pad[:, None]) & (cols[None, :] < P)
    pad_u = torch.tensor([P - len(r.prompt) for r in uniq], device=dev)
    key_u = (cols[None, :P] >= pad_u[:, None])
    positions = (cols[None, :P] - pad_u[:, None]).clamp(min=0)
    causal = torch.ones((P, P), dtype=torch.bool, device=dev).tril()
    # A padding query may see nothing; letting it see itself keeps softmax finite.
    mask = (causal[None] & key_u[:, None, :]) | torch.eye(P, dtype=torch.bool, device=dev)
    if U == B:  # nothing shared: prefill straight into the decode cache
        hidden = model.forward(ids, positions, lora, cache, mask[:, None])
        logits = model.logits(hidden[:, -1:], lora)[:, 0]
    else:
        lora_u = LoraBatch([r.adapter for r in uniq], model.dtype, dev)
        prompt_cache = model.new_cache(U, P)
        hidden = model.forward(ids, positions, lora_u, prompt_cache, mask[:, None])
        cache.k[:, :, :, :P] = prompt_cache.k.index_select(1, of_t)
        cache.v[:, :, :, :P] = prompt_cache.v.index_select(1, of_t)
        del prompt_cache
        logits = model.logits(hidden[:, -1:], lora_u)[:, 0].index_select(0, of_t)
    cache.length = P

    results = [SampleResult(sequences=[]) for _ in requests]
    first_row: dict[int, int] = {}  # request -> one of its rows (all share its prompt)
    for b, r in enumerate(rows):
        first_row.setdefault(r.req, b)
    for i, b in first_row.items():
        if wants_scores(requests[i]):
            n, u = len(rows[b].prompt), of[b]
            score_prompt(model, requests[i], rows[b].adapter, hidden[u, P - n:], ids[u, P - n:],
                         results[i])
    topk = max(r.topk_sample for r in requests)

    chooser = _chooser(rows, dev)
    # No CUDA graph under tensor parallelism (a step's collectives stay eager) nor for an
    # MoE model (its routing has data-dependent shapes).
    decode = _Decoder(model, lora, cache, key_ok,
                      graph=dev.type == "cuda" and max_new > 8 and model.shard is None
                      and not model.moe)
    for t in range(max_new):
        tokens, lps, logp = chooser.select(logits, topk)
        top = top_rows(logp, topk)
        for b, (tok, lp) in enumerate(zip(tokens.tolist(), lps.tolist(), strict=True)):
            r = rows[b]
            if r.done is None:
                r.tokens.append(tok)
                r.logprobs.append(lp)
                if r.top is not None:
                    k = requests[r.req].topk_sample
                    r.top[0].append(top[0][b][:k])
                    r.top[1].append(top[1][b][:k])
                r.done = stop_reason(model, r.params, r.tokens)
        if all(r.done is not None for r in rows) or t == max_new - 1:
            break
        logits = decode(tokens, P + t, P + t - pad)

    for r in sorted(rows, key=lambda r: r.req):  # stable: samples keep their order
        results[r.req].sequences.append(SampledSequence(r.tokens, r.logprobs, r.done or "length",
                                                        r.top))
    return results


class _Decoder:
    """One decode step for the whole batch. On CUDA the step is captured once as a graph
    and replayed: a small model's decode is otherwise bound by kernel launches."""

    def __init__(self, model: BaseModel, lora: LoraBatch, cache, key_ok: torch.Tensor, graph: bool):
        self.model, self.lora, self.cache, self.key_ok = model, lora, cache, key_ok
        B, dev = key_ok.shape[0], key_ok.device
        self.tok = torch.zeros((B, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros((B, 1), dtype=torch.long, device=dev)
        self.use_graph = graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def _run(self, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model.forward(self.tok, self.pos, self.lora, self.cache, mask)
        return self.model.logits(hidden, self.lora)[:, 0]

    def __call__(self, tokens: torch.Tensor, at: int, positions: torch.Tensor) -> torch.Tensor:
        """Feed `tokens` (one per row) at cache position `at`; returns next-token logits."""
        self.key_ok[:, at] = True
        self.tok.copy_(tokens[:, None])
        self.pos.copy_(positions[:, None])
        if not self.use_graph:
            self.cache.length = at
            return self._run(self.key_ok[:, None, None, : at + 1])
        if self.graph is None:
            self.cache.index = torch.tensor([at], device=self.tok.device)
            mask = self.key_ok[:, None, None, :]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture, as CUDA graphs need
                self._run(mask)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._run(mask)
        self.cache.index.fill_(at)
        self.graph.replay()
        return self.out


def _chooser(rows: list[_Row], dev: torch.device) -> RowChoice:
    by_req: dict[int, list[int]] = {}
    for b, r in enumerate(rows):
        if r.params.temperature > 0:
            by_req.setdefault(r.req, []).append(b)
    groups = [(idx, request_generator(rows[idx[0]].params, dev)) for idx in by_req.values()]
    return RowChoice.of([r.params for r in rows], groups, dev)
