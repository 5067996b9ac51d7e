"""A paged KV cache for sampling: fixed-size pages from one preallocated pool.

Every layer's keys and values live in one pool of `pages` pages of `page_size` token slots
([layers, pages * page_size, kv_heads, head_dim]). A sequence holds a block table, the
list of its pages in order; position p of the sequence is slot
`table[p // page_size] * page_size + p % page_size`. Pages are reference-counted: the
samples of one prompt share the prompt's full pages (the prompt's last, partial page is
copied, so each continuation writes only to pages of its own and no copy-on-write is
needed), and a finished sequence gives its pages back at once for waiting requests.

Page 0 is never handed out: it is where padding writes go and what unused block-table
entries point at. Those reads are masked out; the page holds finite values (it starts at
zero and only ever receives computed keys), so masked rows never turn into NaN.

How attention reads pages. A `PagedView` is what `BaseModel.forward` takes as its cache
(the `write(layer, k, v) -> (k, v)` protocol of `KVCache`): it scatters the step's new keys
into their slots and gathers each row's pages into a contiguous [B, kv_heads, L, dim]
view, which the model's ordinary `scaled_dot_product_attention` reads with a mask. We chose
the gather over flex_attention's paged block masks because it runs unchanged on CPU (the
tests) and inside a CUDA graph, needs no compilation, and leaves model.py's attention (the
training path) untouched. The price is memory traffic: the keys a step reads are read,
written and read again (about 3x what a fused paged kernel moves). So a decode step (one
new token a row) on CUDA takes the fused path instead: a view given the rows' `lengths`
stores the new keys and values and runs kernels/paged_decode.py, which reads each row's pages
in place (`attend_raw`: the norms, rotation and store as one kernel, kernels/qk_prep.py);
the gather stays for prefill and as the reference path (`kernels=False`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .kernels.paged_decode import Prefix
    from .shared_decode import SharedStep


class PagePool:
    """The pages, their reference counts and the free list."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, v_dim: int | None = None,
                 latent: bool = False):
        # `v_dim` (None: head_dim): the values' width. `latent`: the pool holds DeepSeek's
        # MLA latents (mla.py) as one "head" of keys, its values zero-wide.
        if pages < 2:
            raise ValueError("a page pool needs at least 2 pages (page 0 is reserved)")
        shape = (n_layers, pages * page_size, n_kv, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros((*shape[:3], head_dim if v_dim is None else v_dim), dtype=dtype,
                             device=device)
        self.latent = latent
        self.pages = pages
        self.page_size = page_size
        self._refs = [0] * pages
        self._free = list(range(pages - 1, 0, -1))  # popped from the end: low ids first
        self._within = torch.arange(page_size, device=device)

    @property
    def free(self) -> int:
        """Pages that can be allocated now."""
        return len(self._free)

    @property
    def usable(self) -> int:
        """Pages a sequence could ever get (all but the reserved page 0)."""
        return self.pages - 1

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} KV pages wanted, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._refs[p] = 1
        return out

    def share(self, pages: list[int], times: int) -> None:
        """`times` more holders of each of `pages`."""
        for p in pages:
            self._refs[p] += times

    def holders(self, page: int) -> int:
        """How many hold `page` (the prefix cache may take a page only it holds)."""
        return self._refs[page]

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def copy_page(self, src: int, dst: list[int]) -> None:
        """Every layer's keys and values of page `src` into each page of `dst`: one copy
        per pool tensor (a fan-out of 256 samples copying its prompt's partial page a
        sample at a time cost 510 small copies)."""
        if not dst:
            return
        to = torch.tensor(dst, device=self.k.device)
        for t in (self.k, self.v):
            pages = t.view(t.shape[0], self.pages, self.page_size, *t.shape[2:])
            page = pages[:, src:src + 1].clone()  # (a source inside the target is refused)
            pages.index_copy_(1, to, page.expand(-1, len(dst), *pages.shape[2:]))

    def slots(self, table: torch.Tensor) -> torch.Tensor:
        """Block tables [B, n] -> the token slots they cover [B, n * page_size]."""
        return (table[:, :, None] * self.page_size + self._within).reshape(table.shape[0], -1)

    def view(self, write: torch.Tensor, table: torch.Tensor,
             lengths: torch.Tensor | None = None, prefix: Prefix | None = None,
             recurrent=None, shared: SharedStep | None = None) -> PagedView:
        return PagedView(self, write, table, lengths, prefix, recurrent, shared)


class PagedView:
    """One forward's access to the pool: `write` [B * S] slots of the new tokens (row-major),
    `table` [B, n] the pages each row attends over (n * page_size positions, in order).

    The gather copies whole pages (page_size x kv_heads x dim contiguous elements each), not
    single positions: on an H100, gathering 256-byte positions ran at a third of the card's
    bandwidth and took 40% of a 256-row decode step.

    With `lengths` [B] (each row's tokens, the new one included) the view is `fused`: a
    one-token step attends through `attend`, the Triton kernel reading the pages in place
    (kernels/paged_decode.py), and nothing is gathered. With `prefix` too
    (paged_decode.prefix_groups) the rows' shared prompt pages are read once per group.
    With `shared` instead (shared_decode.SharedStep) `attend` is the torch
    cascade of shared_decode.py (no Triton: the CPU's). `recurrent`: the rows' linear-attention
    states (recurrent.py; Qwen3.5), else None."""

    def __init__(self, pool: PagePool, write: torch.Tensor, table: torch.Tensor,
                 lengths: torch.Tensor | None = None, prefix: Prefix | None = None,
                 recurrent=None, shared: SharedStep | None = None):
        self.pool, self.recurrent, self.shared = pool, recurrent, shared
        self.write_slots = write
        self.table, self.lengths, self.prefix = table, lengths, prefix
        self.batch, self.length = table.shape[0], table.shape[1] * pool.page_size

    @property
    def fused(self) -> bool:
        return self.lengths is not None or self.shared is not None

    @property
    def latent(self) -> bool:
        """Keys are MLA latents (mla.py: the attention expands them)."""
        return self.pool.latent

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new keys/values [B, kv, S, dim] into their slots."""
        B, H, S, _ = k.shape
        for pool, new in ((self.pool.k[layer], k), (self.pool.v[layer], v)):
            pool.index_copy_(0, self.write_slots,
                             new.transpose(1, 2).reshape(B * S, H, new.shape[-1]))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Store the new token's keys/values and attend: q [B, heads, 1, dim] -> the same."""
        self.store(layer, k, v)
        if self.shared is not None:
            from . import shared_decode

            return shared_decode.attend(q, self.pool.k[layer], self.pool.v[layer],
                                        self.shared, self.pool.page_size, scale)
        return self._paged(layer, q[:, :, 0], scale)[:, :, None]

    def attend_raw(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, norms, scale: float) -> torch.Tensor:
        """`attend` for the paged kernel's view (`lengths`) from the GEMM's q [B, 1, heads,
        dim], k and v [B, 1, kv, dim] before their norms (`norms`: qk_prep's) and rotation:
        one kernel (kernels/qk_prep.py) does those and the store -> [B, heads, dim]."""
        from .kernels.qk_prep import qk_prep

        q = qk_prep(q, k, v, cos, sin, norms, self.pool.k[layer], self.pool.v[layer],
                    self.write_slots)
        return self._paged(layer, q, scale)

    def _paged(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        from .kernels.paged_decode import paged_decode

        return paged_decode(q, self.pool.k[layer], self.pool.v[layer], self.table,
                            self.lengths, self.pool.page_size, scale, prefix=self.prefix)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store the new keys/values [B, kv, S, dim]; return each row's [B, kv, L, dim]."""
        self.store(layer, k, v)
        pages = self.table.reshape(-1)
        return tuple(self._gather(t[layer], pages) for t in (self.pool.k, self.pool.v))

    def _gather(self, slots: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """One layer's [pages * page_size, H, D] -> the rows' pages [B, H, L, D]."""
        H, D = slots.shape[1], slots.shape[2]
        # (the pool's page count, not -1: a latent pool's values hold no element to count)
        paged = slots.view(self.pool.pages, self.pool.page_size, H, D)
        return paged.index_select(0, pages).view(self.batch, self.length, H, D).transpose(1, 2)
