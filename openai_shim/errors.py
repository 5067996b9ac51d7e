"""Errors as the OpenAI API answers them: `{"error": {"message", "type", "param", "code"}}`.

The routes raise `OpenAIError` (or the service's own errors, mapped here), so every refusal
names the parameter at fault where there is one, and the daemon's other faces keep their
own error shapes.
"""

from __future__ import annotations

import logging

from aiohttp import web

from twinkled.core.service import Draining, RateLimited
from twinkled.core.streams import SampleFailed
from twinkled.protocol.errors import NotFound, UserError

log = logging.getLogger("twinkled.oai")


class OpenAIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message, param, status, type, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return web.json_response(self.body(), status=self.status, headers=headers)


def bad_param(param: str | None, message: str) -> OpenAIError:
    return OpenAIError(message, param)


def model_not_found(name: str) -> OpenAIError:
    return OpenAIError(f"The model {name!r} does not exist or you do not have access to it.",
                       "model", 404, code="model_not_found")


UNAUTHORIZED = OpenAIError("Incorrect or missing API key: send it as "
                           "'Authorization: Bearer <key>'", None, 401,
                           "invalid_request_error", "invalid_api_key").body()


def as_openai(e: Exception) -> OpenAIError:
    """The service's errors in OpenAI's shape."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, RateLimited):
        return OpenAIError(str(e), None, 429, "rate_limit_error", "rate_limit_exceeded")
    if isinstance(e, Draining):
        return OpenAIError(str(e), None, 503, "server_error", "draining")
    if isinstance(e, NotFound):
        return OpenAIError(str(e), None, 404, code="not_found")
    if isinstance(e, UserError):
        return OpenAIError(str(e))
    if isinstance(e, SampleFailed):
        return OpenAIError(str(e), None, 500, "server_error")
    raise e


def openai_errors(handler):
    """Route wrapper: whatever a route raises leaves as an OpenAI error body."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except (OpenAIError, UserError, Draining, SampleFailed) as e:
            return as_openai(e).response()
        except web.HTTPException:
            raise
        except Exception as e:  # a bug: logged, and still an answer the client can read
            log.exception("%s %s failed", request.method, request.path)
            return OpenAIError(f"server error: {type(e).__name__}: {e}", None, 500,
                               "server_error").response()

    return wrapped
