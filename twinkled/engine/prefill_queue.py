"""The running batch's prompts between admission and their first token: chunked prefill.

Admission (running.py) gives a request its pages and rows at once and queues its distinct
prompt here. Every step then runs ONE prefill pass of at most `budget` tokens before the
decode step of the running rows: the queued prompts' next pieces, first come first served,
the last of them cut where the budget ends (varlen: prefill.py). So a prompt longer than
the budget is prefilled over several steps, and the running rows go on decoding a token a
step meanwhile instead of waiting for the whole prompt. A prompt whose last piece ran is
`Ready`: its next-token logits choose its samples' first tokens and they join the batch.

The result is the same as one unchunked pass: a piece attends to the keys its earlier
pieces wrote into the pages (as to a cached prefix). A prompt whose scores are asked keeps
its pieces' hidden states until the last one (prompt_scores.py reads every position).

`varlen=False` is the padded reference (prefix_cache.prefill): the queue then prefills
everything queued in one pass, whole (admission keeps it under the padded budget), as the
running batch did before chunking; only a prompt longer than the budget is cut, into
passes of its own (a 128K prompt would otherwise stall every running row for its whole
prefill, and its mask alone would be 128K x 128K).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_pages import PagePool
from .lora import Adapter
from .lora_rows import AdapterStack, row_lora
from .moe import ExpertRows, run_tokens
from .prefill import Piece, prefill_varlen
from .prefix_cache import prefill
from .recurrent import PromptState
from .vision_prefill import PromptVision


@dataclass(eq=False)
class Pending:
    """A distinct prompt (of one adapter) being prefilled into `pages`, and the requests
    (running_seqs.Request) it serves."""

    prompt: list[int]
    adapter: Adapter | None
    pages: list[int]
    done: int  # positions whose keys and values are in the pages
    scored: bool  # keep every position's hidden state
    requests: list = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    state: PromptState | None = None  # linear attention's (Qwen3.5), from piece to piece
    vision: PromptVision | None = None  # its images (a VL model's: vision_prefill.py)


@dataclass
class Ready:
    """A prompt now whole in its pages."""

    prompt: Pending
    logits: torch.Tensor  # [V] the next token's
    hidden: torch.Tensor | None  # [n, H] every position's, where scores were asked


class PrefillQueue:
    def __init__(self, model, pool: PagePool, stack: AdapterStack, kernels: bool,
                 budget: int, varlen: bool = True):
        self.model, self.pool, self.stack, self.kernels = model, pool, stack, kernels
        self.budget, self.varlen = budget, varlen
        self.queue: list[Pending] = []

    @property
    def pending(self) -> bool:
        return bool(self.queue)

    def add(self, prompts: list[Pending]) -> None:
        if self.model.hybrid is not None:  # each prompt's linear-attention state, from empty
            for p in prompts:
                p.state = PromptState()
        self.queue += prompts

    def run(self) -> list[Ready]:
        """One pass over the queue's next pieces; the prompts it finished."""
        if not self.queue:
            return []
        pieces = self._plan()
        mine = self.queue[:len(pieces)]  # the pass's prompts
        last = [i for i, (p, piece) in enumerate(zip(mine, pieces, strict=True))
                if piece.end == len(p.prompt)]
        if self.varlen:
            hidden, logits = prefill_varlen(self.model, self.pool, self.stack, self.kernels,
                                            pieces, last)
        else:
            hidden, logits = self._padded(pieces)
            logits = logits[last]
        ready, left = [], []
        for i, (p, piece) in enumerate(zip(mine, pieces, strict=True)):
            p.done = piece.end
            if p.scored:
                p.hidden.append(hidden[i])
            if p.done == len(p.prompt):
                ready.append(Ready(p, logits[len(ready)],
                                   torch.cat(p.hidden) if p.scored else None))
            else:
                left.append(p)
        self.queue = left + self.queue[len(pieces):]
        return ready

    def _plan(self) -> list[Piece]:
        """The pass's pieces: the queue's prompts in order, until the budget is spent
        (the padded path: all of them, whole, but for a prompt longer than the budget)."""
        room, out = self.budget, []
        for p in self.queue:
            n = len(p.prompt) - p.done
            if self.varlen:
                n = min(n, room)
                if n <= 0:
                    break
            elif n > self.budget:
                # Padded too, a long prompt is cut: a pass of its own per piece (pieces
                # after the first read the earlier ones' keys from the pages, as a cached
                # prefix), so running rows decode between them. Its mask is [piece, prompt]:
                # pieces of at most budget^2 / prompt tokens keep it to budget^2 cells
                # (a 128K prompt at 16K a pass: 2K-token pieces, 256 MB of mask).
                if out:
                    break
                n = max(1, min(self.budget, self.budget ** 2 // len(p.prompt)))
                return [Piece(p.prompt, p.done, p.done + n, p.pages, p.adapter, p.state, p.vision)]
            out.append(Piece(p.prompt, p.done, p.done + n, p.pages, p.adapter, p.state, p.vision))
            room -= n
        return out

    def _padded(self, pieces: list[Piece]) -> tuple[list[torch.Tensor], torch.Tensor]:
        lora = row_lora(self.stack, [p.adapter for p in pieces], self.kernels)
        if self.model.moe:  # the experts' LoRA: row i's flat tokens i*S..(i+1)*S (padded)
            width = max(p.tokens for p in pieces)
            lora = ExpertRows(lora, run_tokens([(p.adapter, width) for p in pieces],
                                               self.model.dtype, self.model.device))
        # A piece of a cut prompt writes and reads only the pages up to its end.
        hidden, logits = prefill(self.model, self.pool, lora, [p.prompt[:p.end] for p in pieces],
                                 [p.start for p in pieces],
                                 [p.pages[:self.pool.pages_for(p.end)] for p in pieces],
                                 [p.vision for p in pieces])
        return [hidden[i, :p.tokens] for i, p in enumerate(pieces)], logits
