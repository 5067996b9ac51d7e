"""The sampler's prefix cache: prompt pages kept across requests, and the prefill that uses them.

A multi-turn rollout sends its conversation again with one more turn; RL re-samples the
same prompt every step. Once a prompt is prefilled, its full KV pages stay in the running
batch's page pool, held by one reference of this cache, and a later request whose prompt
starts with the same pages (for the same weights) reuses the longest such run and prefills
only the rest.

What a page is cached under. A page's keys and values depend on the weights and on every
token up to its end, so an entry is keyed by a chained hash of (the previous page's hash,
the weights key, this page's tokens). The weights key is the adapter's id and the version
of the weights the running batch computed with (`AdapterStack.weights_version`, which
changes at every optimizer step, load or copy: `Bank.changed`); the base model's is
(None, 0). A hash only finds a candidate: the entry is served only if its stored tokens,
weights key and parent entry are the ones asked for, so a collision can cost a miss,
never wrong KV. Only full pages are cached (a continuation writes into the prompt's
partial page), and a lookup leaves at least the prompt's last token to prefill (its
logits choose the first sampled token).

Memory. Cached pages come out of the same pool as running rows; a page held by the cache
alone is as good as free: an allocation that needs it evicts it. Eviction is least
recently used, leaves first: a lookup or insert touches a chain from its end to its root,
so an entry is always more recent than its children, and only an entry with no cached
children and no holder but the cache goes. A budget (a fraction of the pool, config
`sample_prefix_cache`) caps the pages the cache holds a reference to; 0 turns it off.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .kv_pages import PagePool
from .lora import Adapter
from .lora_rows import AdapterStack
from .vision_prefill import pass_inputs

WeightsKey = tuple  # (adapter id, weights version), (None, 0) for the base model


@dataclass(eq=False)
class _Entry:
    page: int
    tokens: tuple[int, ...]
    weights: WeightsKey
    parent: _Entry | None
    children: int = 0
    hash: int = 0


@dataclass
class CacheStats:
    """Prompt tokens served from the cache and prefilled, since the batch was made."""

    cached_tokens: int = 0
    prefilled_tokens: int = 0
    evicted_pages: int = 0


def weights_key(stack: AdapterStack, adapter: Adapter | None) -> WeightsKey:
    """What a row's keys and values depend on besides its tokens: the weights the running
    batch computes `adapter`'s rows with (it holds them in `stack`)."""
    return (None, 0) if adapter is None else (adapter.id, stack.weights_version(adapter))


class PrefixCache:
    """Full prompt pages of `pool`, at most `share` of its pages (0: the cache is off)."""

    def __init__(self, pool: PagePool, share: float):
        self.pool, self.share = pool, share
        self.budget = int(share * pool.usable)  # pages
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by hash, LRU first
        self.stats = CacheStats()

    @property
    def pages(self) -> int:
        """Pages the cache holds a reference to."""
        return len(self._entries)

    def lookup(self, weights: WeightsKey, prompt: list[int]) -> list[int]:
        """The pages of the longest cached run of `prompt`'s full pages (all but its last
        token at most), each with one more holder: the caller's, released with its pages."""
        found: list[_Entry] = []
        n = (len(prompt) - 1) // self.pool.page_size if self._entries else 0
        for h, toks in self._chain(weights, prompt, n):
            e = self._entries.get(h)
            if e is None or not self._matches(e, weights, toks, found[-1] if found else None):
                break
            found.append(e)
        self._touch(found)
        pages = [e.page for e in found]
        self.pool.share(pages, 1)
        return pages

    def prompt_pages(self, prompts: list[tuple[WeightsKey | None, list[int]]], need: int
                     ) -> tuple[list[list[int]], list[int]]:
        """Pages for each (weights, prompt) about to prefill: its longest cached run first
        (no lookup where weights is None), then new ones; and where each prefill starts.
        `need`: every page the caller allocates now, these included (room is made for it)."""
        hits = [[] if w is None else self.lookup(w, p) for w, p in prompts]
        self.make_room(need - sum(map(len, hits)))
        starts = [len(h) * self.pool.page_size for h in hits]
        self.count(sum(starts), sum(len(p) for _, p in prompts) - sum(starts))
        return [h + self.pool.allocate(self.pool.pages_for(len(p)) - len(h))
                for (_, p), h in zip(prompts, hits, strict=True)], starts

    def insert(self, weights: WeightsKey, prompt: list[int], pages: list[int]) -> None:
        """Cache `pages`, the prefilled full pages of `prompt` (the caller holds them)."""
        if not self.budget:
            return
        chain: list[_Entry] = []
        for (h, toks), page in zip(self._chain(weights, prompt, len(pages)), pages, strict=True):
            parent = chain[-1] if chain else None
            e = self._entries.get(h)
            if e is not None:
                # Children go only under an entry of this very page: the caller holds it, so
                # a held child never sits under a parent the cache alone holds.
                if not self._matches(e, weights, toks, parent) or e.page != page:
                    break
            else:
                if len(self._entries) >= self.budget and not self._evict(1):
                    break
                e = self._entries[h] = _Entry(page, toks, weights, parent, hash=h)
                self.pool.share([page], 1)
                if parent is not None:
                    parent.children += 1
            chain.append(e)
        self._touch(chain)

    def reclaimable(self) -> int:
        """Pages only the cache holds: an allocation may take them (`make_room`)."""
        return sum(self.pool.holders(e.page) == 1 for e in self._entries.values())

    def make_room(self, pages: int) -> None:
        """Evict until `pages` pages are free in the pool (or nothing more can go)."""
        short = pages - self.pool.free
        if short > 0:
            self._evict(short)

    def count(self, cached: int, prefilled: int) -> None:
        self.stats.cached_tokens += cached
        self.stats.prefilled_tokens += prefilled

    # -- internals --------------------------------------------------------------------

    def _chain(self, weights: WeightsKey, prompt: list[int], n: int):
        """(hash, tokens) of `prompt`'s first `n` pages, each hash chained on the previous."""
        P, h = self.pool.page_size, 0
        for i in range(n):
            toks = tuple(prompt[i * P:(i + 1) * P])
            h = hash((h, weights, toks))
            yield h, toks

    @staticmethod
    def _matches(e: _Entry, weights: WeightsKey, toks: tuple, parent: _Entry | None) -> bool:
        return e.parent is parent and e.weights == weights and e.tokens == toks

    def _touch(self, chain: list[_Entry]) -> None:
        """Most recent use: the chain's end first, its root last (parents outlive children)."""
        for e in reversed(chain):
            self._entries.move_to_end(e.hash)

    def _evict(self, n: int) -> int:
        """Evict up to `n` least recently used leaves held by the cache alone; returns how many."""
        gone = 0
        for e in list(self._entries.values()):  # LRU first; a parent comes after its children
            if gone == n:
                break
            if e.children == 0 and self.pool.holders(e.page) == 1:
                del self._entries[e.hash]
                if e.parent is not None:
                    e.parent.children -= 1
                self.pool.release([e.page])
                gone += 1
        self.stats.evicted_pages += gone
        return gone


def prefill(model, pool: PagePool, lora, prompts: list[list[int]],  # lora: row_lora(...)
            starts: list[int], pages: list[list[int]], visions: list | None = None):
    """The padded prefill pass (`RunningBatch(prefill="padded")`, the reference of
    prefill.py's packed one): one forward of `prompts` (right-padded) from positions
    `starts` (the keys and values before them are already in the prompts' first `pages`), writing the
    rest of their keys and values into `pages`; returns the hidden states [U, S, H] of the
    positions computed (row i's position j is prompt position starts[i] + j) and the
    last prompt position's logits [U, V]. `visions`: each prompt's images
    (vision_prefill.PromptVision, or None)."""
    dev = model.device
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    start = torch.tensor(starts, device=dev)
    S = int((lens - start).max())
    width = pool.pages_for(int(lens.max()))
    ids = torch.zeros((len(prompts), S), dtype=torch.long)
    table = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p) - starts[i]] = torch.tensor(p[starts[i]:])
        table[i, :len(pages[i])] = torch.tensor(pages[i])
    ids, table = ids.to(dev), table.to(dev)
    cols = torch.arange(S, device=dev)
    positions = start[:, None] + cols[None, :]  # [U, S]
    real = positions < lens[:, None]
    slots = pool.slots(table).gather(1, positions.clamp(max=width * pool.page_size - 1))
    write = slots * real  # padding writes go to page 0
    keys = torch.arange(width * pool.page_size, device=dev)
    # Row i's query j sees the prompt's keys up to its own position (cached ones included).
    mask = (keys[None, None, :] <= positions[:, :, None]) & (keys[None, None, :] < lens[:, None, None])
    mm = visions and pass_inputs(model, [(v, s, len(p)) for v, s, p in zip(
        visions, starts, prompts, strict=True)], S)
    rope, images = mm or (positions, None)
    hidden = model.forward(ids, rope, lora, pool.view(write.reshape(-1), table), mask[:, None],
                           images=images)
    last = hidden[torch.arange(len(prompts), device=dev), lens - start - 1]
    return hidden, model.logits(last[:, None], lora)[:, 0]
