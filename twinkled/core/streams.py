"""Sampling as a stream: each choice's tokens, piece by piece, as the engine makes them.

A protocol that streams (the OpenAI face, `openai_shim/`) reads a `SampleStream` with
`async for`; a `Piece` is some new tokens of one choice. The stream is fed by the same queued
sample op as Tinker's asample (`Service.sample`: quotas, fair share, co-batching), so it
is no side door.

The workers decode samples in slices (`sample_slice_ms`, twinkled/core/pending_samples.py):
after each slice the engine core hands a streamed op's new tokens to `feed`, one piece per
choice, and when the sample finishes its result goes to `encode` (the op's future's
encoder), which pushes what the slices had not yet sent, with each choice's finish reason,
and ends the stream. With slicing off (or on a tensor-parallel or MoE worker group, whose
sampler runs to completion) the first pieces are the whole choices. `cancel` takes the
op out of the queue, or out of the workers' running batches if it already runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from twinkled.core.futures import Future
from twinkled.protocol.errors import UserError

# Per sampled token: (ids, logprobs) of the top-k alternatives.
TopRows = tuple[Sequence[Sequence[int]], Sequence[Sequence[float]]]


class SampleFailed(Exception):
    """The sample op failed on the daemon's side (category "server")."""


@dataclass(frozen=True)
class Piece:
    """New tokens of choice `choice`; `finish` ("stop" | "length") on its last piece."""

    choice: int
    tokens: list[int]
    logprobs: list[float]
    top: TopRows | None = None
    finish: str | None = None


@dataclass(frozen=True)
class PromptScores:
    """What the op asked about its prompt (SampleF.prompt_logprobs, topk_prompt): one entry
    per prompt token, the first None (no context)."""

    logprobs: list[float | None] | None
    top: TopRows | None


class SampleStream:
    """The pieces of one queued sample op, read once with `async for`. `prompt` holds the
    prompt's scores, when asked for, from before the first piece on."""

    def __init__(self, withdraw: Callable[[Future, str], bool]):
        self._withdraw = withdraw
        self._queue: asyncio.Queue[Piece | None] = asyncio.Queue()
        self.future: Future | None = None  # set by Service.sample_stream
        self.cancelled = False
        self.prompt: PromptScores | None = None
        self.cached_tokens = 0  # prompt tokens the prefix cache served, with the result
        self._sent: dict[int, int] = {}  # choice -> tokens pushed so far

    def feed(self, partials: Sequence[Any]) -> None:
        """A slice's new tokens of each choice (engine SampledSequence, stop_reason "")."""
        for i, seq in enumerate(partials):
            if seq.tokens:
                self.push(Piece(i, list(seq.tokens), list(seq.logprobs), seq.topk))
                self._sent[i] = self._sent.get(i, 0) + len(seq.tokens)

    def encode(self, result: Any) -> tuple[bytes, str]:
        """The future's encoder: hands the engine's result to the reader as pieces, and
        stores only a summary (the reader has the tokens; nobody polls this future)."""
        if result.prompt_logprobs is not None or result.topk_prompt is not None:
            self.prompt = PromptScores(result.prompt_logprobs, result.topk_prompt)
        self.cached_tokens = result.cached_tokens
        for i, seq in enumerate(result.sequences):
            n = self._sent.get(i, 0)  # what `feed` already pushed
            top = None if seq.topk is None else (seq.topk[0][n:], seq.topk[1][n:])
            self.push(Piece(i, list(seq.tokens[n:]), list(seq.logprobs[n:]), top,
                            seq.stop_reason))
        self._queue.put_nowait(None)
        made = sum(len(s.tokens) for s in result.sequences)
        return msgspec.json.encode({"sequences": len(result.sequences), "tokens": made}), \
            "application/json"

    def push(self, piece: Piece) -> None:
        if not self.cancelled:
            self._queue.put_nowait(piece)

    async def __aiter__(self) -> AsyncIterator[Piece]:
        f = self.future
        while True:
            get = asyncio.ensure_future(self._queue.get())
            done = asyncio.ensure_future(f.done.wait())
            await asyncio.wait([get, done], return_when=asyncio.FIRST_COMPLETED)
            done.cancel()
            if not get.done():
                get.cancel()
                if f.error is not None:
                    message, category = f.error
                    raise (UserError if category == "user" else SampleFailed)(message)
                continue  # resolved: its pieces are queued
            piece = get.result()
            if piece is None:
                return
            yield piece

    def cancel(self) -> bool:
        """The reader went away: the sample is taken out of the queue, or out of the
        workers' running batches (True); False if it already finished."""
        self.cancelled = True
        return self.future is not None and self._withdraw(
            self.future, "cancelled: the client went away before the sample finished")
