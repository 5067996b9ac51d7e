"""Errors as Anthropic's API answers them:
`{"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}`.

The shared text path raises `OpenAIError`s (status and the parameter at fault) and the
service its own errors; each is mapped here by status to Anthropic's error types, so the
`anthropic` client raises the exception it documents (BadRequestError, NotFoundError,
RateLimitError, ...) and retries only what is worth retrying (429, 529, 5xx).
"""

from __future__ import annotations

import logging

from aiohttp import web

from openai_shim.errors import OpenAIError, as_openai
from twinkled.core.service import Draining
from twinkled.core.streams import SampleFailed
from twinkled.protocol.errors import UserError

log = logging.getLogger("twinkled.anthropic")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
         500: "api_error", 529: "overloaded_error"}
OVERLOADED = 529  # Anthropic's "come back shortly" (a draining daemon; OpenAI's face says 503)


def error_body(status: int, message: str, request_id: str | None = None) -> dict:
    kind = TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    out = {"type": "error", "error": {"type": kind, "message": message}}
    if request_id:
        out["request_id"] = request_id
    return out


UNAUTHORIZED = error_body(401, "invalid x-api-key: send the key as 'x-api-key: <key>' (or "
                               "'Authorization: Bearer <key>')")


def as_anthropic(e: Exception) -> tuple[int, str]:
    """The status and message of a face or service error, in Anthropic's terms."""
    err: OpenAIError = as_openai(e)  # re-raises what is not a known error (a bug)
    status = OVERLOADED if isinstance(e, Draining) or err.status == 503 else err.status
    message = err.message
    # Anthropic names the field at fault first: "max_tokens: Field required".
    if err.param and not message.startswith(err.param):
        message = f"{err.param}: {message}"
    return status, message


def response(request: web.Request, status: int, message: str) -> web.Response:
    headers = {"Retry-After": "1"} if status in (429, OVERLOADED) else None
    return web.json_response(error_body(status, message, request.get("request_id")),
                             status=status, headers=headers)


def anthropic_errors(handler):
    """Route wrapper: whatever a route raises leaves as an Anthropic error body."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except (OpenAIError, UserError, Draining, SampleFailed) as e:
            return response(request, *as_anthropic(e))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return response(request, e.status, e.text or e.reason)  # e.g. a body too large
        except Exception as e:  # a bug: logged, and still an answer the client can read
            log.exception("%s %s failed", request.method, request.path)
            return response(request, 500, f"server error: {type(e).__name__}: {e}")

    return wrapped
