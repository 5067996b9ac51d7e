"""The OpenAI-compatible routes under `/oai/api/v1`: completions, chat completions, models.

A request is decoded and checked at the door (messages.py), its `model` resolved to the
base model or sampler weights the key may read (models.py), its prompts tokenized
(tokens.py), and each prompt queued as one sample op through the same service command as
Tinker's asample (`Service.sample_stream`: quotas, fair share, co-batching with every other
tenant's samples). The answer is built from the stream of tokens (choices.py), whole or
as server-sent events (streaming.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from tinker_shim.common import limits, service
from twinkled.core.streams import Piece, SampleFailed, SampleStream
from twinkled.protocol.checks import check_prompt_scores, check_token_ids
from twinkled.protocol.errors import UserError
from twinkled.protocol.frames import SampleF, SamplingF, buf
from twinkled.protocol.types import EngineInputError

from .choices import ChoiceText, Delta, TokenOut, chat_logprobs, completion_logprobs
from .echo import echoed
from .errors import bad_param, openai_errors
from .messages import (
    ChatRequest,
    CompletionRequest,
    Sampling,
    chat_messages,
    check_chat,
    check_completion,
    check_sampling,
    decode,
    prompts,
)
from .models import Target, listing, resolve
from .streaming import EventStream, freed_if_gone, merged
from .tokens import TextSide, TextSideSlot

V1 = "/oai/api/v1"
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /completions
# Chat's default in OpenAI's API is the rest of the context; the sampler reserves its KV
# cache for max_tokens up front, so a client that leaves it out gets at most this.
CHAT_MAX_TOKENS = 4096
GREEDY_BELOW = 1e-5  # a temperature this small is greedy sampling


@dataclass
class Job:
    """One request, checked: what to sample and how to answer."""

    body: Sampling
    chat: bool
    target: Target
    side: TextSide
    stops: list[str]
    prompts: list[list[int]]
    max_tokens: list[int]
    topk: int  # top-k logprobs per token
    logprobs: bool
    echo: bool = False  # the prompt comes back before each completion (completions only)

    @property
    def sampled(self) -> bool:
        """False for echo with max_tokens 0: the prompt (and its scores) alone."""
        return min(self.max_tokens) > 0

    @property
    def n(self) -> int:
        return self.body.n


async def models(request: web.Request) -> web.Response:
    return web.json_response(listing(request))


async def _door(request, message: type, check) -> tuple:
    """The body decoded and checked, its stop strings, its target and the tokenizer."""
    body = decode(await request.read(), message)
    lim = limits(request)
    stops = check_sampling(body, lim)
    check(body, lim)
    return body, stops, resolve(request, body.model), await request.app["oai_text"].get()


async def completions(request: web.Request) -> web.StreamResponse:
    body, stops, target, side = await _door(request, CompletionRequest, check_completion)
    given = prompts(body.prompt)
    if len(given) * body.n > limits(request).max_num_samples:
        raise bad_param("prompt", f"{len(given)} prompts x n={body.n} is more than "
                        f"{limits(request).max_num_samples} completions in one request")
    ids = [p if isinstance(p, list) else await _tokens(request, side, "prompt", p, side.encode)
           for p in given]
    job = Job(body, False, target, side, stops, ids,
              _budgets(request, ids, body.max_tokens, "max_tokens", "prompt",
                       COMPLETION_MAX_TOKENS),
              body.logprobs or 0, body.logprobs is not None, body.echo)
    return await _answer(request, job)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body, stops, target, side = await _door(request, ChatRequest, check_chat)
    messages = chat_messages(body)
    _fits(request, side, "messages", sum(len(m["content"]) + len(m.get("name") or "")
                                         for m in messages))
    text = await side.off_loop(side.chat_text, messages)
    ids = [await _tokens(request, side, "messages", text, side.encode_templated)]
    asked, param = body.max_completion_tokens, "max_completion_tokens"
    if asked is None:
        asked, param = body.max_tokens, "max_tokens"
    job = Job(body, True, target, side, stops, ids,
              _budgets(request, ids, asked, param, "messages", CHAT_MAX_TOKENS),
              body.top_logprobs or 0, body.logprobs)
    return await _answer(request, job)


async def _tokens(request, side: TextSide, param: str, text: str, encode) -> list[int]:
    """`text`'s ids, unless it cannot fit the context: refused by its length, or as soon
    as counting it in pieces reaches the context (tokenizing 30 MiB at once took
    gigabytes; a piece costs little)."""
    _fits(request, side, param, len(text))
    ctx = limits(request).max_seq_len
    if await side.off_loop(side.reaches, text, ctx):
        raise bad_param(param, f"the prompt is more than {ctx} tokens, this model's context")
    return await side.off_loop(encode, text)


def _fits(request, side: TextSide, param: str, length: int) -> None:
    """A prompt (characters of text, or token ids) that cannot fit the context is refused
    before it is tokenized or scored: tokenizing 30 MiB of text took gigabytes."""
    ctx = limits(request).max_seq_len
    most = side.max_chars(ctx)
    if most is not None and length > most:
        raise bad_param(param, f"the prompt is {length} characters: more than {ctx} tokens "
                        f"(this model's context) however it tokenizes (a token covers at "
                        f"most {side.chars_per_token} characters)")


def _budgets(request, ids: list[list[int]], asked: int | None, param: str, prompt_param: str,
             default: int) -> list[int]:
    """Each prompt's max_tokens: as asked (within the context), else `default` (or the
    rest of the context, if less)."""
    lim = limits(request)
    ctx, out = lim.max_seq_len, []
    for p in ids:
        if len(p) >= ctx:
            raise bad_param(prompt_param, f"the prompt is {len(p)} tokens; this model's "
                            f"context is {ctx} tokens")
        try:
            check_token_ids(prompt_param, p, lim.vocab_size)
        except EngineInputError as e:
            raise bad_param(prompt_param, str(e)) from None
        if not p:
            raise bad_param(prompt_param, "the prompt is empty")
        if asked is None:
            out.append(min(default, ctx - len(p)))
        elif len(p) + asked > ctx:
            raise bad_param(param, f"{param} ({asked}) + the prompt ({len(p)} tokens) is "
                            f"more than this model's context of {ctx} tokens")
        else:
            out.append(asked)
    return out


def _queue(request, job: Job) -> list[SampleStream]:
    """One sample op per prompt, through the service's sample command."""
    body, svc = job.body, service(request)
    # Stop strings are cut out here (choices.py); the engine stops at them too, and at
    # the end-of-sequence tokens (which its stop-string check sees only as text).
    stop = [*job.stops, *job.side.eos_texts] if job.stops else None
    temperature = 1.0 if body.temperature is None else body.temperature
    if temperature < GREEDY_BELOW:  # dividing logits by it would overflow
        temperature = 0.0
    top_p = 1.0 if body.top_p is None else body.top_p
    streams: list[SampleStream] = []
    try:
        for p, max_tokens in zip(job.prompts, job.max_tokens, strict=True):
            # max_tokens 0 (echo): one token is sampled, and dropped.
            params = SamplingF(max(1, max_tokens), temperature, -1, top_p, body.seed, stop)
            scored = job.echo and job.logprobs
            _check_scores(request, p, scored, job.topk if scored else 0, job.topk)
            frame = SampleF(job.target.adapter, buf(p, "int64"), params, job.n,
                            prompt_logprobs=scored, load_from=job.target.load_from,
                            topk_prompt=job.topk if scored else 0, topk_sample=job.topk)
            streams.append(svc.sample_stream(request["tenant"], job.target.owner, frame))
    except BaseException:
        for s in streams:
            s.cancel()
        raise
    return streams


def _check_scores(request, prompt: list[int], scored: bool, topk_prompt: int,
                  topk: int) -> None:
    try:
        check_prompt_scores(prompt, scored, None, topk_prompt, topk, 0, None, limits(request))
    except EngineInputError as e:
        raise bad_param("logprobs", str(e)) from None


class _Deltas:
    """Each choice's deltas from the pieces of its stream, the echoed prompt first."""

    def __init__(self, job: Job, streams: list[SampleStream]):
        self.job, self.streams = job, streams
        self.choices = [ChoiceText(job.side, job.stops, offsets=job.logprobs)
                        for _ in range(len(job.prompts) * job.n)]
        self._shift: dict[int, int] = {}  # choice -> length of its echoed prompt

    def of(self, stream: int, piece: Piece) -> tuple[int, list[Delta]]:
        job, c = self.job, stream * self.job.n + piece.choice
        out = []
        if job.echo and c not in self._shift:
            out.append(echoed(job.side, job.prompts[stream], self.streams[stream].prompt))
            self._shift[c] = len(out[0].text)
        if not job.sampled:
            self.choices[c].finish = "length"
            out.append(Delta("", [], "length"))
            return c, out
        made = self.choices[c].feed(piece)
        for d in made:
            for t in d.tokens:
                t.offset += self._shift.get(c, 0)
        return c, out + made


async def _answer(request, job: Job) -> web.StreamResponse:
    streams = _queue(request, job)
    fmt = _Format(job, f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}")
    deltas = _Deltas(job, streams)
    if job.body.stream:
        return await _stream(request, job, fmt, streams, deltas)
    texts = [""] * len(deltas.choices)
    tokens: list[list[TokenOut]] = [[] for _ in deltas.choices]
    async with freed_if_gone(request, streams):
        async for i, piece in merged(streams):
            c, made = deltas.of(i, piece)
            for d in made:
                texts[c] += d.text
                tokens[c].extend(d.tokens)
    return web.json_response({
        **fmt.head(), "choices": [fmt.whole(c, ch.finish, texts[c], tokens[c])
                                  for c, ch in enumerate(deltas.choices)],
        "usage": _usage(job, deltas)})


async def _stream(request, job: Job, fmt: _Format, streams: list[SampleStream],
                  deltas: _Deltas) -> web.StreamResponse:
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
                            "usage": _usage(job, deltas)})
        return await out.close()
    except ConnectionError:  # the client went away mid-stream: its samples were freed
        return out.response


def _usage(job: Job, deltas: _Deltas) -> dict:
    prompt = sum(len(p) for p in job.prompts)
    made = sum(c.count for c in deltas.choices)
    cached = sum(s.cached_tokens for s in deltas.streams)  # the sampler's prefix cache
    return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made,
            "prompt_tokens_details": {"cached_tokens": cached}}


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
    r.add_post(f"{V1}/completions", openai_errors(completions))
    r.add_post(f"{V1}/chat/completions", openai_errors(chat_completions))
