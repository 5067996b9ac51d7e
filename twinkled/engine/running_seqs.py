"""What the running batch (running.py) keeps per request and per sample."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from twinkled.protocol.types import SampleRequest, SampleResult

from .choose import request_generator, stop_reason
from .lora import Adapter


@dataclass
class Finished:
    """A request whose samples have all stopped."""

    ticket: int
    result: SampleResult


class Request:
    """One admitted sampling request: its samples (`seqs`) and what they all share."""

    def __init__(self, ticket: int, req: SampleRequest, adapter: Adapter | None, model):
        self.ticket, self.req, self.adapter = ticket, req, adapter
        self.result = SampleResult(sequences=[])
        self.gen = request_generator(req.params, model.device)
        self.stop = partial(stop_reason, model, req.params)  # tokens -> why it stops, or None
        self.seqs: list[Seq] = []
        self.running = 0
        self.cancelled = False
        # What a shared prefill must agree on (images: their placeholder ids are all alike).
        self.key = (None if adapter is None else adapter.id, tuple(req.prompt),
                    tuple(im.digest for im in req.images))


class Seq:
    """One sample: its pages (the prompt's shared ones first) and what it generated."""

    def __init__(self, request: Request, pages: list[int], length: int, index: int = 0):
        self.request, self.pages = request, pages
        self.index = index  # its place in request.seqs (its sample number)
        self.length = length  # positions in the KV cache (written, or by a step in flight)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.sent = 0  # tokens already handed out by `RunningBatch.pieces`
        self.top: tuple[list, list] | None = ([], []) if request.req.topk_sample else None
        self.done: str | None = None

    def record(self, token: int, logprob: float, top: tuple[list, list], b: int) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.top is not None:
            k = self.request.req.topk_sample
            self.top[0].append(top[0][b][:k])
            self.top[1].append(top[1][b][:k])
        self.done = self.request.stop(self.tokens)
