"""Each HTTP request as an OpenTelemetry server span (twinkled/core/otel.py says when tracing
is on and what the request's ops add under it). The middleware is only installed when
tracing is on, so a daemon without it pays nothing per request."""

from __future__ import annotations

import time

from aiohttp import web

from twinkled.core import otel


@web.middleware
async def traced(request: web.Request, handler):
    from opentelemetry import trace
    from opentelemetry.propagate import extract

    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "(unmatched)"
    started = time.time_ns()
    span = otel.tracer().start_span(
        f"{request.method} {route}", context=extract(request.headers),
        kind=trace.SpanKind.SERVER, start_time=started,
        attributes={"http.request.method": request.method, "http.route": route,
                    "url.path": request.path})
    token = otel.in_request(trace.set_span_in_context(span), started)
    status = 500
    try:
        with trace.use_span(span, end_on_exit=False):
            response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    finally:
        otel.end_request(token)
        span.set_attribute("http.response.status_code", status)
        if request.get("tenant"):
            span.set_attribute("twinkle.tenant", request["tenant"])
        if request.get("request_id"):
            span.set_attribute("twinkle.request_id", request["request_id"])
        if status >= 500:
            span.set_status(trace.Status(trace.StatusCode.ERROR))
        span.end()
