"""OpenAI's Responses API (`POST /oai/api/v1/responses`), the official client's
`client.responses.create`, whole or streamed, over the chat path.

A request is translated once at the door into a chat completion request (`instructions` the
system message, `input` a user message or a list of message items, `input_text` /
`output_text` / `input_image` parts) and checked by the chat face's own rules; the answer is
one `message` output item holding one `output_text` part. Streaming sends the typed events
of the Responses API (response.created ... response.output_text.delta ...
response.completed), each with its `sequence_number`.

Nothing is stored (`store` is accepted and answered false), so `previous_response_id` and
`conversation` are refused by name, as are tools, structured output and background runs.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from aiohttp import web
from msgspec import Struct

from tinker_shim.common import limits
from twinkled.core.streams import SampleFailed
from twinkled.protocol.errors import UserError

from . import images as oai_images
from .errors import as_openai, bad_param
from .messages import (
    ChatMessage,
    ChatRequest,
    Count,
    ImageUrl,
    TextPart,
    chat_messages,
    check_chat,
    check_sampling,
    decode,
)
from .sampling import (
    CHAT_MAX_TOKENS,
    Deltas,
    Job,
    Knobs,
    budgets,
    queue,
    target_and_side,
    whole,
)
from .streaming import EventStream, freed_if_gone, merged


class InputPart(Struct, kw_only=True):
    type: str  # input_text, output_text (an earlier answer), input_image
    text: str | None = None
    image_url: str | None = None  # input_image: a data URL
    detail: str | None = None


class InputItem(Struct, kw_only=True):
    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None


class TextFormat(Struct, kw_only=True):
    type: str = "text"


class TextConfig(Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint: ignored


class ResponsesRequest(Struct, kw_only=True):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # nothing is stored either way
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextConfig | None = None
    # Hints this server has no use for: accepted, ignored.
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # Known and not served: refused by name when asked for.
    tools: list[Any] | None = None
    tool_choice: Any = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None


def as_chat(body: ResponsesRequest) -> ChatRequest:
    """The request as the chat face's, or a 400 naming what this server does not serve."""
    for name in ("previous_response_id", "conversation"):
        if getattr(body, name) is not None:
            raise bad_param(name, f"{name}: this server stores no responses; send the whole "
                            "conversation in input")
    if body.tools:
        raise bad_param("tools", "tools (tool calling) are not supported by this server")
    if body.tool_choice not in (None, "none", "auto"):
        raise bad_param("tool_choice", "tool calling is not supported by this server")
    if body.background:
        raise bad_param("background", "background responses are not supported by this server")
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        raise bad_param("text.format", "only the text format is supported by this server (no "
                        "JSON mode or schemas)")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise bad_param("max_output_tokens", "max_output_tokens must be at least 1, got "
                        f"{body.max_output_tokens}")
    messages = [ChatMessage(role="system", content=body.instructions)] \
        if body.instructions else []
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
    else:
        messages += [_message(i, item) for i, item in enumerate(body.input)]
    if not any(m.role != "system" for m in messages):
        raise bad_param("input", "input must hold at least one message")
    return ChatRequest(model=body.model, messages=messages, temperature=body.temperature,
                       top_p=body.top_p, stream=body.stream, user=body.user,
                       max_completion_tokens=body.max_output_tokens)


def _message(i: int, item: InputItem) -> ChatMessage:
    if item.type != "message" or item.role is None:
        raise bad_param(f"input[{i}]", f"input items of type {item.type!r} are not supported "
                        "by this server (messages with a role are)")
    if not isinstance(item.content, list):
        return ChatMessage(role=item.role, content=item.content or "")
    parts = []
    for j, p in enumerate(item.content):
        if p.type in ("input_text", "output_text") and p.text is not None:
            parts.append(TextPart(type="text", text=p.text))
        elif p.type == "input_image" and p.image_url is not None:
            parts.append(TextPart(type="image_url", image_url=ImageUrl(url=p.image_url)))
        else:
            raise bad_param(f"input[{i}].content[{j}]", "content parts are input_text, "
                            "output_text or input_image (with an image_url data URL)")
    return ChatMessage(role=item.role, content=parts)


async def responses(request: web.Request) -> web.StreamResponse:
    body = decode(await request.read(), ResponsesRequest)
    chat = as_chat(body)
    lim = limits(request)
    check_sampling(chat, lim)
    check_chat(chat, lim)
    target, side = await target_and_side(request, body.model)
    prompt, images = await oai_images.chat_prompt(
        request, side, chat_messages(chat), oai_images.chat_images(chat.messages), body.model)
    ids = [prompt]
    job = Job(body, Knobs(body.temperature, body.top_p), True, target, side, [], ids,
              budgets(request, ids, body.max_output_tokens, "max_output_tokens", "input",
                      CHAT_MAX_TOKENS), images=images)
    answer = _Answer(job)
    if body.stream:
        return await _stream(request, job, answer)
    deltas, texts, _ = await whole(request, job)
    return web.json_response(answer.response(deltas, texts[0]))


class _Answer:
    """The response object and its output item, in the Responses API's shape."""

    def __init__(self, job: Job):
        self.job, self.created = job, int(time.time())
        self.id, self.item = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"

    def part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def message(self, text: str | None) -> dict:
        done = text is not None
        return {"id": self.item, "type": "message", "role": "assistant",
                "status": "completed" if done else "in_progress",
                "content": [self.part(text)] if done else []}

    def response(self, deltas: Deltas | None, text: str | None) -> dict:
        body = self.job.body
        out = {"id": self.id, "object": "response", "created_at": self.created,
               "status": "in_progress", "incomplete_details": None, "error": None,
               "model": body.model, "instructions": body.instructions,
               "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
               "output": [], "parallel_tool_calls": False, "previous_response_id": None,
               "reasoning": None, "store": False, "temperature": body.temperature,
               "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [],
               "top_p": body.top_p, "truncation": "disabled", "user": body.user,
               "usage": None}
        if deltas is None:
            return out
        length = deltas.choices[0].finish == "length"
        out.update(status="incomplete" if length else "completed",
                   incomplete_details={"reason": "max_output_tokens"} if length else None,
                   output=[self.message(text)], usage={
                       "input_tokens": deltas.prompt_tokens,
                       "input_tokens_details": {"cached_tokens": deltas.cached_tokens},
                       "output_tokens": deltas.completion_tokens,
                       "output_tokens_details": {"reasoning_tokens": 0},
                       "total_tokens": deltas.prompt_tokens + deltas.completion_tokens})
        return out


async def _stream(request: web.Request, job: Job, answer: _Answer) -> web.StreamResponse:
    streams = queue(request, job)  # refused here (quota, ...): a plain error answer
    deltas = Deltas(job, streams)
    out = EventStream(request)
    seq = 0
    where = {"item_id": answer.item, "output_index": 0, "content_index": 0}

    async def send(event: str, data: dict) -> None:
        nonlocal seq
        await out.send({"type": event, "sequence_number": seq, **data}, event)
        seq += 1

    try:
        async with freed_if_gone(request, streams):
            await out.open()
            head = answer.response(None, None)
            await send("response.created", {"response": head})
            await send("response.in_progress", {"response": head})
            await send("response.output_item.added",
                       {"output_index": 0, "item": answer.message(None)})
            await send("response.content_part.added", {**where, "part": answer.part("")})
            text = ""
            try:
                async for i, piece in merged(streams):
                    for d in deltas.of(i, piece)[1]:
                        if d.text:
                            text += d.text
                            await send("response.output_text.delta",
                                       {**where, "delta": d.text, "logprobs": []})
            except (UserError, SampleFailed) as e:  # after the stream began: an event
                err = as_openai(e)
                await send("error", {"code": err.code, "message": err.message,
                                     "param": err.param})
                return await out.close(done=False)
        await send("response.output_text.done", {**where, "text": text, "logprobs": []})
        await send("response.content_part.done", {**where, "part": answer.part(text)})
        await send("response.output_item.done",
                   {"output_index": 0, "item": answer.message(text)})
        final = answer.response(deltas, text)
        await send("response.completed" if final["status"] == "completed"
                   else "response.incomplete", {"response": final})
        return await out.close(done=False)
    except ConnectionError:  # the client went away mid-stream: its samples were freed
        return out.response
