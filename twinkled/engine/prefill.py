"""Varlen prefill: many prompts' pieces as ONE packed row of tokens, written straight into pages.

The padded prefill (prefix_cache.prefill, kept as the reference) lays the prompts out as a
[prompts, longest] batch, so a pass costs prompts x longest tokens of compute and a [prompts,
longest, pages x page_size] attention mask. Here each prompt's piece (positions start..end,
the KV before `start` already in its pages: a cached prefix, or earlier chunks) is laid end
to end with the others, as training packs rows (packed.py): a pass costs its tokens.

Attention: every piece's queries against its own keys, causal and aligned to the end (a
piece's query at position p sees keys 0..p). Where no piece has keys before its start, the
keys are the pass's own k and v as computed; otherwise they are read back from the pages
after the pass's keys are stored (one gather of every piece's positions 0..end). On a GPU in
half precision the attention is flash attention's varlen kernel (packed.varlen_attend, the
training path's: causal is aligned to the end of each segment's keys); elsewhere one SDPA
call per piece, the same math.

LoRA: each token carries its piece's adapter: a per-token mask over the adapter stack's
columns (the masked path), or per-token (start, rank, scale) for the kernels
(kernels/lora_decode.py, which sorts rows by adapter anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .kv_pages import PagePool
from .lora import Adapter
from .lora_rows import AdapterStack, kernel_group, row_lora
from .moe import ExpertRows, run_tokens
from .packed import varlen_attend
from .recurrent import PieceStates, PromptState
from .vision_prefill import PromptVision, pass_inputs


@dataclass
class Piece:
    """Positions start..end of `prompt` to prefill into `pages` (its whole block table)."""

    prompt: list[int]
    start: int
    end: int
    pages: list[int]
    adapter: Adapter | None
    state: PromptState | None = None  # its linear-attention state (Qwen3.5), carried on
    vision: PromptVision | None = None  # its prompt's images (a VL model's)

    @property
    def tokens(self) -> int:
        return self.end - self.start


class _TokenLora:
    """The masked LoRA of a packed row: token t uses the stack's columns `mask[t]` picks."""

    def __init__(self, stack: AdapterStack, mask: torch.Tensor):
        self.stack, self.mask = stack, mask  # [T, width]

    def apply(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = self.stack.A.get(key)
        if a is None:
            return y
        h = F.linear(x, a) * self.mask  # x [1, T, in]
        y.view(-1, y.shape[-1]).addmm_(h.view(-1, h.shape[-1]), self.stack.B[key].t())
        return y


class _TokenKernelLora:
    """`_TokenLora` through the kernels: token t reads only its adapter's columns."""

    def __init__(self, stack: AdapterStack, start: torch.Tensor, rank: torch.Tensor,
                 scale: torch.Tensor):
        self.stack, self.rows, self._plan = stack, (start, rank, scale), None

    def apply(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return kernel_group(self.stack, self._rows_plan, (key,), x, [y])[0]

    def apply_shared(self, keys: tuple[str, ...], x: torch.Tensor,
                     ys: list[torch.Tensor]) -> list[torch.Tensor]:
        """`apply` for modules that read the same x (q/k/v; gate/up): one launch pair."""
        return kernel_group(self.stack, self._rows_plan, keys, x, ys)

    def _rows_plan(self):
        if self._plan is None:  # once a pass: every module shares it
            from .kernels import lora_decode  # triton: only where the kernels run

            self._plan = lora_decode.plan(*self.rows)
        return self._plan


def token_lora(stack: AdapterStack, pieces: list[Piece], kernels: bool):
    """The LoRA of a packed pass: each token uses its piece's adapter."""
    dev, counts = stack.device, torch.tensor([p.tokens for p in pieces])
    if not kernels:  # (a mask row per piece copied, repeated on the device)
        masks = torch.stack([stack.mask_row(p.adapter) for p in pieces]).to(dev)
        return _TokenLora(stack, masks.repeat_interleave(
            counts.to(dev), 0, output_size=int(counts.sum())))
    start, rank, scale = (torch.tensor(v).repeat_interleave(counts) for v in zip(
        *(stack.row(p.adapter) for p in pieces), strict=True))
    return _TokenKernelLora(stack, start.to(dev, torch.int32), rank.to(dev, torch.int32),
                            scale.to(dev, torch.float32))


class _PackedPages:
    """The pass's cache and attention (what `BaseModel.forward` takes as `cache` and
    `packing`): stores every new key into its slot, then attends each piece's queries to
    its keys 0..end."""

    def __init__(self, pool: PagePool, pieces: list[Piece], device):
        P = pool.page_size
        self.pool = pool
        self.flash = pool.k.is_cuda and pool.k.dtype in (torch.float16, torch.bfloat16)
        self.q_lens = [p.tokens for p in pieces]
        self.starts = [p.start for p in pieces]
        # Flash: each piece's keys 0..end, read back from the pages only where some piece
        # has keys before its start. Elsewhere every piece reads its whole pages back,
        # masked, as the padded pass does: SDPA's CPU kernel rounds by its blocks of keys,
        # and in bf16 a prefill over the prompt's keys alone put the sampler's logprobs
        # 0.0054 nats from the trainer's where the padded pass's were 0.0030
        # (tests/test_logprob_gap.py).
        self.reread = any(self.starts) or not self.flash
        self.k_lens = [p.end if self.flash else pool.pages_for(p.end) * P for p in pieces]
        write, read = [], []
        for p, L in zip(pieces, self.k_lens, strict=True):
            table = torch.tensor(p.pages)
            pos = torch.arange(L) if self.reread else torch.arange(p.start, p.end)
            slots = table[pos // P] * P + pos % P
            write.append(slots[p.start:p.end] if self.reread else slots)
            read.append(slots)
        self.write_slots = torch.cat(write).to(device)
        self.read_slots = torch.cat(read).to(device) if self.reread else None
        self.cu_q = _offsets(self.q_lens, device)
        self.cu_k = _offsets(self.k_lens, device) if self.reread else self.cu_q
        self.recurrent = (PieceStates([p.state for p in pieces])
                          if pieces[0].state is not None else None)
        # The LoRA of the keys read back (each piece's 0..k_len, its adapter's), where they
        # go through a linear: MLA expands its latents through kv_b_proj (mla.py). None:
        # the keys are the pass's own tokens (the pass's LoRA serves).
        self.key_lora = None

    @property
    def latent(self) -> bool:
        """Keys are MLA latents (mla.py: the attention expands them)."""
        return self.pool.latent

    @property
    def lengths(self) -> list[int]:
        """Each piece's tokens, in pass order (linear attention cuts the pass by them)."""
        return self.q_lens

    def memory_tokens(self) -> int:
        return sum(self.q_lens)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [1, kv, T, dim]; return every piece's keys and values end to end."""
        out = []
        for pool, new in ((self.pool.k[layer], k), (self.pool.v[layer], v)):
            pool.index_copy_(0, self.write_slots, new[0].transpose(0, 1))
            if self.reread:
                new = pool.index_select(0, self.read_slots).transpose(0, 1)[None]
            out.append(new)
        return out[0], out[1]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               gqa: bool) -> torch.Tensor:
        """q [1, H, T, D], k/v [1, Hkv, Tk, D] -> [1, H, T, D]."""
        if self.flash:
            return varlen_attend(q, k, v, self.cu_q, self.cu_k, max(self.q_lens),
                                 max(self.k_lens), scale, gqa)
        outs, qa, ka = [], 0, 0
        for n, L, s in zip(self.q_lens, self.k_lens, self.starts, strict=True):
            # Query j sits at position s + j and sees keys 0..s + j.
            mask = (torch.arange(L, device=q.device)[None, :]
                    <= torch.arange(s, s + n, device=q.device)[:, None])
            outs.append(F.scaled_dot_product_attention(
                q[:, :, qa:qa + n], k[:, :, ka:ka + L], v[:, :, ka:ka + L], attn_mask=mask,
                scale=scale, enable_gqa=gqa))
            qa, ka = qa + n, ka + L
        return torch.cat(outs, dim=2)


def _offsets(lengths: list[int], device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def prefill_varlen(model, pool: PagePool, stack: AdapterStack, kernels: bool,
                   pieces: list[Piece], logits_of: list[int]
                   ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """One packed forward of `pieces`, their keys and values written into their pages;
    returns each piece's hidden states [tokens, H] and the next-token logits [len, V] of
    the last position of the pieces `logits_of` names (indices into `pieces`)."""
    dev = model.device
    ids = torch.tensor([t for p in pieces for t in p.prompt[p.start:p.end]], device=dev)
    positions = torch.cat([torch.arange(p.start, p.end) for p in pieces]).to(dev)
    pages = _PackedPages(pool, pieces, dev)
    lora = token_lora(stack, pieces, kernels)
    if pool.latent and pages.reread:
        pages.key_lora = token_lora(stack, [replace(p, start=0, end=L) for p, L in zip(
            pieces, pages.k_lens, strict=True)], kernels)
    if model.moe:  # the experts' LoRA: each piece's tokens through its adapter's bank
        lora = ExpertRows(lora, run_tokens([(p.adapter, p.tokens) for p in pieces],
                                           model.dtype, dev))
    mm = pass_inputs(model, [(p.vision, p.start, p.end) for p in pieces], None)
    positions, images = mm or (positions[None], None)
    hidden = model.forward(ids[None], positions, lora, pages, packing=pages, images=images)[0]
    own = list(torch.split(hidden, pages.q_lens))
    if not logits_of:
        return own, None
    last = torch.stack([own[i][-1] for i in logits_of])
    lora = row_lora(stack, [pieces[i].adapter for i in logits_of], kernels)
    return own, model.logits(last[:, None], lora)[:, 0]
