"""Request bodies of the OpenAI face as typed messages (msgspec), decoded and checked once at
the door. A body that does not fit is a 400 naming the parameter (`temperature`,
`messages[0].role`); bounds that depend on the model (context, vocabulary) are checked
where the prompt is known (routes.py). Unknown fields are ignored, as newer clients send
more; known ones this server cannot honour are refused by name.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, TypeVar

from msgspec import Meta, Struct

from tinker_shim.messages import decode as decode_body
from twinkled.protocol.checks import Limits
from twinkled.protocol.errors import UserError

from .errors import bad_param

M = TypeVar("M")

Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]  # ranges are checked with a message


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class Sampling(Struct, kw_only=True):
    """What completions and chat completions share."""

    model: str
    max_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Count | None = None  # not OpenAI's; vLLM's servers take it too
    n: Count = 1
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(Sampling, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of such lists (checked in
    # `prompts`: msgspec takes one array type per union).
    prompt: str | list[Any]
    logprobs: Count | None = None
    echo: bool = False
    best_of: Count | None = None
    suffix: str | None = None


class ImageUrl(Struct, kw_only=True):
    url: str
    detail: str | None = None  # (one resolution is served: the model's processor's)


class TextPart(Struct, kw_only=True):
    """A content part: text, or an image_url (images.py takes those)."""
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    # Known and not served: refused by name when asked for (checked in `check_chat`).
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


_AT = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def decode(raw: bytes, message: type[M]) -> M:
    """`raw` as `message` (the Tinker face's decoder), or a 400 naming the parameter that
    does not fit."""
    try:
        return decode_body(raw, message)
    except UserError as e:
        text = str(e)
        at, missing = _AT.search(text), _MISSING.search(text)
        param = missing.group(1) if missing else (at.group(1) if at else None)
        if at and missing and at.group(1):  # a nested object lacks a field
            param = f"{at.group(1)}.{missing.group(1)}"
        raise bad_param(param or None, text[:1].upper() + text[1:]) from None


def check_sampling(body: Sampling, limits: Limits) -> list[str]:
    """The shared knobs in range; returns the stop strings as a list."""
    if body.temperature is not None and not (math.isfinite(body.temperature)
                                             and 0 <= body.temperature <= 2):
        raise bad_param("temperature", f"temperature must be in [0, 2], got {body.temperature}")
    if body.top_p is not None and not 0 < body.top_p <= 1:
        raise bad_param("top_p", f"top_p must be in (0, 1], got {body.top_p}")
    if body.top_k is not None and body.top_k < 1 and body.top_k != -1:
        raise bad_param("top_k", f"top_k must be -1 (off) or at least 1, got {body.top_k}")
    if not 1 <= body.n <= limits.max_num_samples:
        raise bad_param("n", f"n must be in 1..{limits.max_num_samples}, got {body.n}")
    least = 0 if getattr(body, "echo", False) else 1  # echo: the prompt alone is an answer
    if body.max_tokens is not None and body.max_tokens < least:
        raise bad_param("max_tokens", f"max_tokens must be at least {least}, got "
                        f"{body.max_tokens}")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise bad_param(name, f"{name} is not supported by this server (send 0 or omit it)")
    if body.logit_bias:
        raise bad_param("logit_bias", "logit_bias is not supported by this server")
    if body.stream_options is not None and not body.stream:
        raise bad_param("stream_options", "stream_options is only allowed with stream=true")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > limits.max_stop:
        raise bad_param("stop", f"at most {limits.max_stop} stop sequences, got {len(stop)}")
    if any(not s or len(s) > limits.max_stop_chars for s in stop):
        raise bad_param("stop", f"stop sequences must have 1..{limits.max_stop_chars} "
                        "characters")
    return stop


def check_completion(body: CompletionRequest, limits: Limits) -> None:
    if body.logprobs is not None and not 0 <= body.logprobs <= limits.max_topk:
        raise bad_param("logprobs", f"logprobs must be in 0..{limits.max_topk}, got "
                        f"{body.logprobs}")
    if body.suffix:
        raise bad_param("suffix", "suffix is not supported by this server")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_param("best_of", "best_of other than n is not supported by this server")


def check_chat(body: ChatRequest, limits: Limits) -> None:
    if not body.messages:
        raise bad_param("messages", "messages must hold at least one message")
    if body.max_completion_tokens is not None and body.max_completion_tokens < 1:
        raise bad_param("max_completion_tokens", "max_completion_tokens must be at least 1, "
                        f"got {body.max_completion_tokens}")
    for name in ("tools", "functions"):
        if getattr(body, name):
            raise bad_param(name, f"{name} (tool calling) is not supported by this server")
    if body.tool_choice not in (None, "none"):
        raise bad_param("tool_choice", "tool calling is not supported by this server")
    if body.response_format is not None and body.response_format.get("type") != "text":
        raise bad_param("response_format", "only the text response format is supported by "
                        "this server (no JSON mode or schemas)")
    k = body.top_logprobs
    if k is not None:
        if not body.logprobs:
            raise bad_param("top_logprobs", "top_logprobs needs logprobs=true")
        if not 0 <= k <= min(20, limits.max_topk):
            raise bad_param("top_logprobs", f"top_logprobs must be in 0..{min(20, limits.max_topk)}"
                            f", got {k}")
    for i, m in enumerate(body.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if part.type == "image_url" and part.image_url is not None:
                continue  # checked in images.py, off the event loop
            if part.type != "text" or part.text is None:
                raise bad_param(f"messages[{i}].content[{j}]", "content parts are text or "
                                "image_url (with its url)")


def prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """A completions `prompt` as a list of prompts, each a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_param("prompt", "prompt must not be empty")
    if all(type(t) is int for t in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompt):
        return list(prompt)
    raise bad_param("prompt", "prompt must be a string, a list of strings, a list of token "
                    "ids, or a list of non-empty lists of token ids")


def chat_messages(body: ChatRequest) -> list[dict]:
    """The messages as the chat template takes them (content parts joined into text)."""
    out = []
    for m in body.messages:
        content = m.content
        if isinstance(content, list) and any(p.type == "image_url" for p in content):
            # As Qwen2-VL's chat template takes parts: it places each image's placeholder.
            content = [{"type": "image"} if p.type == "image_url" else
                       {"type": "text", "text": p.text} for p in content]
        elif isinstance(content, list):
            content = "".join(p.text for p in content)
        msg = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out
