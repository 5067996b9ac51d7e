"""Server-sent events, and what happens when the client goes away.

A streamed answer is `data: <json>\\n\\n` per chunk and `data: [DONE]\\n\\n` at the end. A
client that disconnects (mid-stream, or before its result) frees its work: samples still
queued are taken out of the queue (`SampleStream.cancel`), and ones already running leave
the workers' running batches at the next sampling step (their pages freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from aiohttp import web

from twinkled.core.streams import Piece, SampleStream

from .errors import OpenAIError, as_openai

CHECK_GONE_S = 0.2  # how often a waiting request looks whether its client is still there


async def merged(streams: list[SampleStream]) -> AsyncIterator[tuple[int, Piece]]:
    """The pieces of several streams (one per prompt) as they come, as (stream, piece)."""
    if len(streams) == 1:
        async for piece in streams[0]:
            yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: SampleStream) -> None:
        try:
            async for piece in s:
                queue.put_nowait((i, piece))
        except Exception as e:  # handed to the reader, which raises it
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


@contextlib.asynccontextmanager
async def freed_if_gone(request: web.Request, streams: list[SampleStream]):
    """Within this block, a client that disconnects has its samples cancelled; so does a
    block left by an error or cancellation before they are read."""
    def cancel_all() -> None:
        for s in streams:
            s.cancel()

    async def watch() -> None:
        while not client_gone(request):
            await asyncio.sleep(CHECK_GONE_S)
        cancel_all()

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    except BaseException:
        cancel_all()
        raise
    finally:
        watcher.cancel()


class EventStream:
    """An SSE response: `send` each chunk, then `close`."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no"})

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, chunk: dict, event: str | None = None) -> None:
        """One event: its data, and its name where the face names events (Anthropic's)."""
        head = f"event: {event}\n".encode() if event else b""
        await self.response.write(head + b"data: " + json.dumps(chunk).encode() + b"\n\n")

    async def fail(self, e: Exception) -> None:
        """An error after the stream began: sent as an event, as OpenAI's API does."""
        err: OpenAIError = as_openai(e)
        await self.send(err.body())

    async def close(self, done: bool = True) -> web.StreamResponse:
        """The end of the stream (with OpenAI's `[DONE]` unless `done` is False)."""
        if done:
            await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
