"""Which waiting requests join the running batch (running.py), and the pages they get.

Admission takes a request whole and first come, first served: the waiting requests join
in order while the batch has rows and KV pages for all their samples (pages that only the
prefix cache holds count as free), and a padded prefill pass would not grow past its
token limit. Each admitted sample holds, from the start, the pages its longest possible
continuation needs (prompt + max_tokens): the prompt's full pages are shared among a
request's samples and among identical (adapter, prompt) pairs admitted together, cached
ones first (prefix_cache.py); each sample has its own pages for the rest. Each distinct
prompt is queued for one prefill (prefill_queue.Pending).
"""

from __future__ import annotations

from collections.abc import Iterable

from twinkled.protocol.types import SampleRequest

from .kv_pages import PagePool
from .lora_rows import AdapterStack
from .prefill_queue import Pending
from .prefix_cache import PrefixCache, weights_key
from .prompt_scores import wants_scores
from .running_seqs import Request, Seq
from .vision_prefill import PromptVision, cache_key


class Admission:
    """Admission to a running batch of `model` over `pool`; `padded`: its prefill passes
    are padded (at most `prefill_tokens` padded tokens each)."""

    def __init__(self, model, pool: PagePool, cache: PrefixCache, stack: AdapterStack,
                 prefill_tokens: int, padded: bool):
        self.model, self.pool, self.cache, self.stack = model, pool, cache, stack
        self.prefill_tokens, self.padded = prefill_tokens, padded

    def pages(self, req: SampleRequest, shared: bool = False) -> int:
        """Pages `req` takes: the prompt's full pages once (none if `shared` with a request
        admitted beside it), and each sample's own pages."""
        n, P = len(req.prompt), self.pool.page_size
        full = n // P
        own = self.pool.pages_for(n + req.params.max_tokens) - full
        return (0 if shared else full) + req.num_samples * own

    def take(self, waiting: Iterable[Request], rows: int) -> list[Request]:
        """The `waiting` requests that join now (first come, first served, while they fit
        in `rows` free rows and the free pages)."""
        take: list[Request] = []
        keys: dict[tuple, int] = {}  # key -> its prompt length
        pages, reclaimed = self.pool.free, False
        for r in waiting:
            shared = r.key in keys
            cost = self.pages(r.req, shared)
            if cost > pages and not reclaimed:  # pages only the prefix cache holds count too
                pages, reclaimed = pages + self.cache.reclaimable(), True
            longest = max([len(r.req.prompt), *keys.values()])
            width = longest * (len(keys) + (not shared))  # of a padded pass
            if (cost > pages or r.req.num_samples > rows
                    or (self.padded and keys and width > self.prefill_tokens)):
                break
            take.append(r)
            keys[r.key] = len(r.req.prompt)
            pages -= cost
            rows -= r.req.num_samples
        return take

    def queue(self, take: list[Request]) -> list[Pending]:
        """Give `take` its pages (each distinct prompt's, cached ones first, and every
        sample's own); returns its distinct prompts, to queue for prefill."""
        pool = self.pool
        firsts: dict[tuple, Request] = {}
        for r in take:
            firsts.setdefault(r.key, r)
            if r.adapter is not None:
                for _ in range(r.req.num_samples):
                    self.stack.acquire(r.adapter)
        uniq = list(firsts.values())
        prompt_pages, starts = self._prompt_pages(take, uniq)
        cached = {u.key: starts[i] for i, u in enumerate(uniq)}
        queued = {u.key: Pending(u.req.prompt, u.adapter, prompt_pages[i], starts[i],
                                 any(wants_scores(r.req) for r in take if r.key == u.key),
                                 vision=PromptVision.of(self.model, u.req.prompt, u.req.images))
                  for i, u in enumerate(uniq)}
        # Every sample's pages: the prompt's full pages shared, its own for the rest. The
        # first sample of a prompt takes the prompt's partial page; the others copy it
        # once it is prefilled (`RunningBatch._seat`).
        spare = {k: p.pages for k, p in queued.items()}
        for r in take:
            p, n = queued[r.key], len(r.req.prompt)
            full = n // pool.page_size
            want = pool.pages_for(n + r.req.params.max_tokens) - full
            for _ in range(r.req.num_samples):
                partial = spare[r.key][full:]
                spare[r.key] = spare[r.key][:full]
                own = partial + pool.allocate(want - len(partial))
                r.seqs.append(Seq(r, p.pages[:full] + own, n, len(r.seqs)))
            r.result.cached_tokens = cached[r.key]
            r.running = r.req.num_samples
            p.requests.append(r)
        return list(queued.values())

    def _prompt_pages(self, take: list[Request], uniq: list[Request]
                      ) -> tuple[list[list[int]], list[int]]:
        """Each distinct prompt's pages (cached ones first) and where its prefill starts;
        a prompt whose scores are asked prefills whole (they read every position)."""
        scored = {r.key for r in take if wants_scores(r.req)}
        firsts = {id(u) for u in uniq}
        need = sum(self.pages(r.req, id(r) not in firsts) for r in take)
        return self.cache.prompt_pages([(None if u.key in scored else cache_key(weights_key(
            self.stack, u.adapter), u.req.images), u.req.prompt) for u in uniq], need)
