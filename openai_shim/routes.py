"""The OpenAI-compatible routes under `/oai/api/v1`: completions, chat completions, models.

A request is decoded and checked at the door (messages.py); the rest is the path every
text face shares (sampling.py): its `model` resolved, its prompts tokenized, each prompt
one sample op through `Service.sample_stream`, the tokens read back as text deltas. This
module writes the answer in OpenAI's shape, whole or as server-sent events (streaming.py).
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from tinker_shim.common import limits
from twinkled.core.streams import SampleFailed, SampleStream
from twinkled.protocol.errors import UserError

from . import images as oai_images
from .choices import TokenOut, chat_logprobs, completion_logprobs
from .errors import bad_param, openai_errors
from .messages import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    check_chat,
    check_completion,
    check_sampling,
    decode,
    prompts,
)
from .models import listing, one
from .responses import responses
from .sampling import (
    CHAT_MAX_TOKENS,
    Deltas,
    Job,
    Knobs,
    budgets,
    queue,
    target_and_side,
    tokens,
    whole,
)
from .streaming import EventStream, freed_if_gone, merged
from .tokens import TextSideSlot

V1 = "/oai/api/v1"
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /completions


async def models(request: web.Request) -> web.Response:
    return web.json_response(listing(request))


async def model(request: web.Request) -> web.Response:
    return web.json_response(one(request, request.match_info["model"]))


async def _door(request, message: type, check) -> tuple:
    """The body decoded and checked, its stop strings, its target and the tokenizer."""
    body = decode(await request.read(), message)
    lim = limits(request)
    stops = check_sampling(body, lim)
    check(body, lim)
    return body, stops, *(await target_and_side(request, body.model))


def _knobs(body) -> Knobs:
    return Knobs(body.temperature, body.top_p, -1 if body.top_k is None else body.top_k,
                 body.seed, body.n)


async def completions(request: web.Request) -> web.StreamResponse:
    body, stops, target, side = await _door(request, CompletionRequest, check_completion)
    given = prompts(body.prompt)
    if len(given) * body.n > limits(request).max_num_samples:
        raise bad_param("prompt", f"{len(given)} prompts x n={body.n} is more than "
                        f"{limits(request).max_num_samples} completions in one request")
    ids = [p if isinstance(p, list) else await tokens(request, side, "prompt", p, side.encode)
           for p in given]
    job = Job(body, _knobs(body), False, target, side, stops, ids,
              budgets(request, ids, body.max_tokens, "max_tokens", "prompt",
                      COMPLETION_MAX_TOKENS),
              body.logprobs or 0, body.logprobs is not None, body.echo)
    return await _answer(request, job)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body, stops, target, side = await _door(request, ChatRequest, check_chat)
    prompt, images = await oai_images.chat_prompt(
        request, side, chat_messages(body), oai_images.chat_images(body.messages), body.model)
    ids = [prompt]
    asked, param = body.max_completion_tokens, "max_completion_tokens"
    if asked is None:
        asked, param = body.max_tokens, "max_tokens"
    job = Job(body, _knobs(body), True, target, side, stops, ids,
              budgets(request, ids, asked, param, "messages", CHAT_MAX_TOKENS),
              body.top_logprobs or 0, body.logprobs, images=images)
    return await _answer(request, job)


async def _answer(request, job: Job) -> web.StreamResponse:
    fmt = _Format(job, f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}")
    if job.body.stream:
        streams = queue(request, job)
        return await _stream(request, job, fmt, streams, Deltas(job, streams))
    deltas, texts, toks = await whole(request, job)
    return web.json_response({
        **fmt.head(), "choices": [fmt.whole(c, ch.finish, texts[c], toks[c])
                                  for c, ch in enumerate(deltas.choices)],
        "usage": _usage(deltas)})


async def _stream(request, job: Job, fmt: _Format, streams: list[SampleStream],
                  deltas: Deltas) -> web.StreamResponse:
    usage = job.body.stream_options is not None and job.body.stream_options.include_usage
    out = EventStream(request)
    try:
        async with freed_if_gone(request, streams):
            await out.open()
            if job.chat:  # the assistant's turn begins at once, before any token
                for c in range(len(deltas.choices)):
                    await out.send(fmt.chunk(c, {"role": "assistant", "content": ""}, None,
                                             None, usage))
            try:
                async for i, piece in merged(streams):
                    c, made = deltas.of(i, piece)
                    for d in made:
                        if d.text or d.finish or (job.logprobs and d.tokens):
                            await out.send(fmt.delta_chunk(c, d, usage))
            except (UserError, SampleFailed) as e:
                await out.fail(e)
                return await out.close()
        if usage:
            await out.send({**fmt.head(True), "choices": [],
                            "usage": _usage(deltas)})
        return await out.close()
    except ConnectionError:  # the client went away mid-stream: its samples were freed
        return out.response


def _usage(deltas: Deltas) -> dict:
    prompt, made = deltas.prompt_tokens, deltas.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made,
            "prompt_tokens_details": {"cached_tokens": deltas.cached_tokens}}


class _Format:
    """The answer's JSON, in the shape of the route (completion or chat completion)."""

    def __init__(self, job: Job, rid: str):
        self.job, self.id, self.created = job, rid, int(time.time())

    def head(self, chunk: bool = False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.job.chat \
            else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.job.body.model}

    def _logprobs(self, tokens: list[TokenOut]) -> dict | None:
        if not self.job.logprobs:
            return None
        if self.job.chat:
            return chat_logprobs(self.job.side, tokens)
        return completion_logprobs(self.job.side, tokens, top=self.job.topk > 0)

    def whole(self, index: int, finish: str | None, text: str,
              tokens: list[TokenOut]) -> dict:
        out = {"index": index, "logprobs": self._logprobs(tokens), "finish_reason": finish}
        if self.job.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["text"] = text
        return out

    def delta_chunk(self, index: int, d, usage: bool) -> dict:
        delta = {"content": d.text} if d.text else {}
        return self.chunk(index, delta, d.finish, self._logprobs(d.tokens), usage)

    def chunk(self, index: int, delta: dict, finish: str | None, logprobs: dict | None,
              usage: bool) -> dict:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if self.job.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta.get("content", "")
        out = {**self.head(True), "choices": [choice]}
        if usage:
            out["usage"] = None
        return out


def add_routes(app: web.Application) -> None:
    """Mount the OpenAI face (where the Tinker face is mounted: twinkled/server/app.py)."""
    cfg = app["service"].config if app["service"] is not None else None
    app["oai_text"] = TextSideSlot(cfg and cfg.model, cfg.model_config if cfg else {})
    r = app.router
    r.add_get(f"{V1}/models", openai_errors(models))
    # (a sampler path holds slashes: tinker://<run>/sampler_weights/<name>)
    r.add_get(f"{V1}/models/{{model:.+}}", openai_errors(model))
    r.add_post(f"{V1}/completions", openai_errors(completions))
    r.add_post(f"{V1}/chat/completions", openai_errors(chat_completions))
    r.add_post(f"{V1}/responses", openai_errors(responses))
