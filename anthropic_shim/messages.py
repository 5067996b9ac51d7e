"""Request bodies of the Anthropic face as typed messages (msgspec), decoded and checked once
at the door, with Anthropic's rules: `max_tokens` required (0: only warm the prompt
cache), `temperature` in [0, 1], `system` a string or text blocks, content a string or a
list of blocks. The sampling knobs (`temperature`, `top_p`, `top_k`) are older clients'
fields (the 2.x SDK sends them through `extra_body`). Unknown fields are ignored (newer
clients send more: `speed`, `service_tier`, `output_config.effort` are hints this server
has no use for); known features it cannot honour (tools, documents, extended thinking,
structured output) are refused by name.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from openai_shim.errors import bad_param
from twinkled.protocol.checks import Limits

Count = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]  # ranges are checked with a message

# Block types Anthropic defines that name a feature this server does not serve.
_FEATURE = {"image": "image input", "document": "document input",
            "tool_use": "tool use", "tool_result": "tool use", "server_tool_use": "tool use",
            "thinking": "extended thinking", "redacted_thinking": "extended thinking",
            "search_result": "search results", "container_upload": "file uploads"}


class ImageSource(Struct, kw_only=True):
    type: str = ""  # "base64" is served ("url", "file": refused by name)
    media_type: str = ""
    data: str = ""


class Block(Struct, kw_only=True):
    type: str
    text: str | None = None
    source: ImageSource | None = None  # an image block's


class Message(Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Metadata(Struct, kw_only=True):
    user_id: str | None = None


class Thinking(Struct, kw_only=True):
    type: str


class OutputConfig(Struct, kw_only=True):
    effort: str | None = None  # a hint: ignored
    format: dict[str, Any] | None = None  # structured output: refused


class MessagesRequest(Struct, kw_only=True):
    model: str
    messages: list[Message]
    max_tokens: Count
    system: str | list[Block] | None = None
    metadata: Metadata | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Count | None = None
    # Known and not served: refused by name when asked for (checked in `check_messages`).
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Thinking | None = None
    mcp_servers: list[Any] | None = None
    output_config: OutputConfig | None = None


class CountTokensRequest(Struct, kw_only=True):
    """`/messages/count_tokens`: the conversation without the sampling knobs."""

    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Thinking | None = None


def check_messages(body: MessagesRequest, limits: Limits) -> list[str]:
    """The knobs in range and the conversation text-only; returns the stop sequences."""
    if body.max_tokens < 0:
        raise bad_param("max_tokens", f"max_tokens must be at least 0, got {body.max_tokens}")
    if body.temperature is not None and not (math.isfinite(body.temperature)
                                             and 0 <= body.temperature <= 1):
        raise bad_param("temperature", f"temperature must be in [0, 1], got {body.temperature}")
    if body.top_p is not None and not 0 < body.top_p <= 1:
        raise bad_param("top_p", f"top_p must be in (0, 1], got {body.top_p}")
    if body.top_k is not None and body.top_k < 1:
        raise bad_param("top_k", f"top_k must be at least 1, got {body.top_k}")
    stop = list(body.stop_sequences or [])
    if len(stop) > limits.max_stop:
        raise bad_param("stop_sequences", f"at most {limits.max_stop} stop sequences, got "
                        f"{len(stop)}")
    if any(not s or len(s) > limits.max_stop_chars for s in stop):
        raise bad_param("stop_sequences", f"stop sequences must have 1.."
                        f"{limits.max_stop_chars} characters")
    if body.mcp_servers:
        raise bad_param("mcp_servers", "MCP servers are not supported by this server")
    if body.output_config is not None and body.output_config.format is not None:
        raise bad_param("output_config.format", "structured output (a JSON schema) is not "
                        "supported by this server")
    check_conversation(body)
    return stop


def check_conversation(body: MessagesRequest | CountTokensRequest) -> None:
    if body.tools:
        raise bad_param("tools", "tools (tool use) are not supported by this server")
    if body.tool_choice is not None:
        raise bad_param("tool_choice", "tool use is not supported by this server")
    if body.thinking is not None and body.thinking.type != "disabled":
        raise bad_param("thinking", "extended thinking is not supported by this server")
    if not body.messages:
        raise bad_param("messages", "messages must hold at least one message")
    if isinstance(body.system, list):
        _text_only("system", body.system)
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            _text_only(f"messages.{i}.content", m.content, images=m.role == "user")


def _text_only(where: str, blocks: list[Block], images: bool = False) -> None:
    """Text blocks, and where `images` base64 image blocks (openai_shim/images.py checks
    their bytes, for a vision-language model)."""
    for j, b in enumerate(blocks):
        if b.type == "image" and images:
            src = b.source
            if src is None or src.type != "base64" or not src.data:
                raise bad_param(f"{where}.{j}", "image blocks take a base64 source (png or "
                                "jpeg); this server fetches no url and keeps no files")
            if src.media_type not in ("image/png", "image/jpeg"):
                raise bad_param(f"{where}.{j}", f"media_type {src.media_type!r} is not "
                                "served (image/png or image/jpeg)")
            continue
        if b.type != "text" or b.text is None:
            feature = _FEATURE.get(b.type, f"{b.type!r} content")
            raise bad_param(f"{where}.{j}", f"{feature} is not supported by this server "
                            "(text blocks only: a text-only model)")


def _text(content: str | list[Block]) -> str:
    return content if isinstance(content, str) else "".join(b.text or "" for b in content)


def _has_images(content: str | list[Block]) -> bool:
    return isinstance(content, list) and any(b.type == "image" for b in content)


def _parts(blocks: list[Block]) -> list[dict]:
    """As Qwen2-VL's chat template takes parts: it places each image's placeholder."""
    return [{"type": "image"} if b.type == "image" else {"type": "text", "text": b.text}
            for b in blocks]


def images_of(body: MessagesRequest | CountTokensRequest) -> list[tuple[bytes, str, str]]:
    """Each image block's (bytes, format, field), in order (checked by openai_shim/images)."""
    from openai_shim.images import data_url

    out = []
    for i, m in enumerate(body.messages):
        for j, b in enumerate(m.content if _has_images(m.content) else ()):
            if b.type == "image":
                where = f"messages.{i}.content.{j}"
                out.append((*data_url(f"data:{b.source.media_type};base64,{b.source.data}",
                                      where), where))
    return out


def chat_of(body: MessagesRequest | CountTokensRequest) -> tuple[list[dict], str]:
    """The conversation as the chat template takes it (the system prompt first), and the
    prefill: a last assistant message is the start of the reply, which continues it (as
    Anthropic's API does), so it is not a turn of its own."""
    out = [{"role": "system", "content": _text(body.system)}] if body.system else []
    out += [{"role": m.role, "content": _parts(m.content) if _has_images(m.content)
             else _text(m.content)} for m in body.messages]
    if out[-1]["role"] == "assistant":
        return out[:-1], out[-1]["content"]
    return out, ""
