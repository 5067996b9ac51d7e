"""The Anthropic-compatible routes under `/anthropic/v1`: messages (whole or streamed),
count_tokens, models.

A thin translation: the body is decoded and checked at the door (messages.py), turned into
the conversation and knobs of the text path every face shares (openai_shim/sampling.py:
model resolution, the chat template, one sample op through `Service.sample_stream`), and
the deltas that path gives are written as an Anthropic message, or as Anthropic's event
stream: message_start, content_block_start, content_block_delta (text_delta) ...,
content_block_stop, message_delta (stop_reason, usage), message_stop.
"""

from __future__ import annotations

import uuid

from aiohttp import web

from openai_shim.choices import ChoiceText
from openai_shim.images import chat_prompt
from openai_shim.messages import decode
from openai_shim.models import listing, one
from openai_shim.sampling import (
    Deltas,
    Job,
    Knobs,
    budgets,
    queue,
    target_and_side,
    whole,
)
from openai_shim.streaming import EventStream, freed_if_gone, merged
from tinker_shim.common import iso_time, limits
from twinkled.core.streams import SampleFailed
from twinkled.protocol.errors import UserError

from .errors import anthropic_errors, as_anthropic, error_body
from .messages import (
    CountTokensRequest,
    MessagesRequest,
    chat_of,
    check_conversation,
    check_messages,
    images_of,
)

V1 = "/anthropic/v1"


async def messages(request: web.Request) -> web.StreamResponse:
    body = decode(await request.read(), MessagesRequest)
    stops = check_messages(body, limits(request))
    target, side = await target_and_side(request, body.model)
    conversation, prefill = chat_of(body)
    prompt, images = await chat_prompt(request, side, conversation, images_of(body),
                                       body.model, prefill)
    ids = [prompt]
    knobs = Knobs(body.temperature, body.top_p, body.top_k or -1)
    job = Job(body, knobs, True, target, side, stops, ids,
              budgets(request, ids, body.max_tokens, "max_tokens", "messages", 0),
              images=images)
    mid = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        return await _stream(request, job, mid)
    deltas, texts, _ = await whole(request, job)
    return web.json_response(_message(job, mid, texts[0], deltas))


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as `messages` would count them (`usage.input_tokens`)."""
    body = decode(await request.read(), CountTokensRequest)
    check_conversation(body)
    _, side = await target_and_side(request, body.model)
    conversation, prefill = chat_of(body)
    prompt, _ = await chat_prompt(request, side, conversation, images_of(body), body.model,
                                  prefill)
    return web.json_response({"input_tokens": len(prompt)})


def _model(m: dict) -> dict:
    return {"type": "model", "id": m["id"], "display_name": m["id"],
            "created_at": iso_time(m["created"])}


async def models(request: web.Request) -> web.Response:
    """The served model, then the key's sampler weights (what `model` may name)."""
    data = [_model(m) for m in listing(request)["data"]]
    return web.json_response({"data": data, "has_more": False, "first_id": data[0]["id"],
                              "last_id": data[-1]["id"]})


async def model(request: web.Request) -> web.Response:
    """One entry of `models` by its id (a sampler path's slashes and all); else a 404."""
    return web.json_response(_model(one(request, request.match_info["model"])))


def _stop(choice: ChoiceText) -> dict:
    """Why the reply ended, in Anthropic's words."""
    if choice.finish == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if choice.stopped_at is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": choice.stopped_at}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(deltas: Deltas) -> dict:
    return {"input_tokens": deltas.prompt_tokens, "output_tokens": deltas.completion_tokens}


def _message(job: Job, mid: str, text: str, deltas: Deltas) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": job.body.model,
            "content": [{"type": "text", "text": text}], **_stop(deltas.choices[0]),
            "usage": _usage(deltas)}


async def _stream(request: web.Request, job: Job, mid: str) -> web.StreamResponse:
    streams = queue(request, job)  # refused here (quota, ...): a plain error answer
    deltas = Deltas(job, streams)
    out = EventStream(request)

    async def send(event: str, data: dict) -> None:
        await out.send({"type": event, **data}, event)

    try:
        async with freed_if_gone(request, streams):
            await out.open()
            await send("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": job.body.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": deltas.prompt_tokens, "output_tokens": 0}}})
            await send("content_block_start", {"index": 0,
                                               "content_block": {"type": "text", "text": ""}})
            try:
                async for i, piece in merged(streams):
                    for d in deltas.of(i, piece)[1]:
                        if d.text:
                            await send("content_block_delta", {"index": 0, "delta": {
                                "type": "text_delta", "text": d.text}})
            except (UserError, SampleFailed) as e:  # after the stream began: an event
                await out.send(error_body(*as_anthropic(e), request.get("request_id")),
                               "error")
                return await out.close(done=False)
        await send("content_block_stop", {"index": 0})
        await send("message_delta", {"delta": _stop(deltas.choices[0]),
                                     "usage": _usage(deltas)})
        await send("message_stop", {})
        return await out.close(done=False)
    except ConnectionError:  # the client went away mid-stream: its samples were freed
        return out.response


def add_routes(app: web.Application) -> None:
    """Mount the Anthropic face (after the OpenAI face, whose tokenizer slot it shares)."""
    r = app.router
    r.add_post(f"{V1}/messages", anthropic_errors(messages))
    r.add_post(f"{V1}/messages/count_tokens", anthropic_errors(count_tokens))
    r.add_get(f"{V1}/models", anthropic_errors(models))
    r.add_get(f"{V1}/models/{{model:.+}}", anthropic_errors(model))
