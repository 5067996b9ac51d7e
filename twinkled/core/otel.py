"""OpenTelemetry traces of requests (optional: the `otel` extra; off by default).

On when the config says `otel = true` or the standard OTEL_TRACES_EXPORTER names an
exporter ("otlp", "console"); OTEL_SDK_DISABLED=true keeps it off. The exporter is
configured by the standard OTEL_EXPORTER_OTLP_* variables (endpoint, headers, protocol
HTTP), the service's name by OTEL_SERVICE_NAME ("twinkled" if unset).

Each HTTP request is a server span (server/otel.py: a middleware, continuing a client's
`traceparent`); an op the request queues adds, as it settles, its children:

    POST /api/v1/forward_backward            the request (answered once queued)
      door check    request start -> queued  (reading and checking the body)
      queued        -> the step that ran it starts
      step          that step: its number, kind, tenants, ops and tokens (one per piece
                    of a request the scheduler cut)
      reply         the step's end -> the result settled (encoded, stored, answered)

A sample decodes in slices across steps: its `sample` span covers queued to settled.
Off, nothing of OpenTelemetry is imported and each hook costs one check of `enabled()`.
"""

from __future__ import annotations

import contextvars
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from twinkled.core.ops import Op

_tracer: Any = None  # an opentelemetry Tracer once `setup` turned tracing on
_provider: Any = None
_request: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar(
    "otel_request", default=None)  # (a context holding the request's span, its start in ns)


@dataclass
class _Traced:
    parent: Any  # a Context holding the request's span
    submitted_ns: int
    steps: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)


# future id -> what its spans need, while the op lives: its `after` holds the entry, so an
# op refused at the door (never settled) takes its entry with it when it is dropped.
_open: weakref.WeakValueDictionary[str, _Traced] = weakref.WeakValueDictionary()


def enabled() -> bool:
    return _tracer is not None


def wanted(config_on: bool) -> bool:
    """Whether tracing is asked for: by the config, or by the standard variables."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    return config_on or exporter not in ("", "none")


def setup(exporter: Any = None) -> None:
    """Turn tracing on, exporting to `exporter` (tests: an in-memory one) or to what the
    OTEL_* variables say, through a batch processor."""
    global _tracer, _provider
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        raise RuntimeError("OpenTelemetry tracing is on (config `otel` or OTEL_TRACES_EXPORTER)"
                           " but its packages are not installed: pip install "
                           "'twinkle[otel]'") from None
    name = os.environ.get("OTEL_SERVICE_NAME") or "twinkled"
    _provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if exporter is not None:
        _provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        _provider.add_span_processor(BatchSpanProcessor(_exporter()))
    _tracer = _provider.get_tracer("twinkled")


def _exporter() -> Any:
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def shutdown() -> None:
    """Send what is buffered and stop (the daemon's shutdown)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None
    _open.clear()


def tracer() -> Any:
    return _tracer


def in_request(parent: Any, started_ns: int) -> contextvars.Token:
    """The current task serves the request whose span `parent` (an OpenTelemetry Context)
    holds, started at `started_ns` (server/otel.py)."""
    return _request.set((parent, started_ns))


def end_request(token: contextvars.Token) -> None:
    _request.reset(token)


def submitted(op: Op) -> None:
    """An op is queued by the current request: its door-check span ends now, and its
    other spans are made as it settles (its `after` is wrapped for that)."""
    req = _request.get()
    if req is None or op.future.id in _open:
        return  # queued by the daemon itself (no request), or an op seen already
    parent, started = req
    now = time.time_ns()
    _tracer.start_span("door check", context=parent, start_time=started).end(end_time=now)
    traced = _open[op.future.id] = _Traced(parent, now)
    then = op.after

    def after(result: Any, message: str | None) -> None:
        if then is not None:
            then(result, message)
        _settled(op, traced, message)
    op.after = after


def stepped(step_no: int, kind: str, ops: list[Op], began: float, ended: float) -> None:
    """A step ran `ops` from `began` to `ended` (wall seconds): what their spans show."""
    info = {"twinkle.step": step_no, "twinkle.step.kind": kind, "twinkle.step.ops": len(ops),
            "twinkle.step.tokens": sum(op.tokens for op in ops),
            "twinkle.step.tenants": sorted({op.future.tenant for op in ops})}
    for op in ops:
        traced = _open.get(op.future.id)
        if traced is not None:
            traced.steps.append((int(began * 1e9), int(ended * 1e9), info))


def _settled(op: Op, traced: _Traced, message: str | None) -> None:
    _open.pop(op.future.id, None)
    if _tracer is None:  # tracing stopped (shutdown) while the op was queued
        return
    now, parent = time.time_ns(), traced.parent
    attrs = {"twinkle.op": op.future.kind, "twinkle.future": op.future.id,
             "twinkle.tokens": op.tokens, **({"error": message} if message else {})}
    if not traced.steps:  # a sample (slices across steps) or an op that never ran
        _span(op.future.kind, parent, traced.submitted_ns, now, attrs)
        return
    _span("queued", parent, traced.submitted_ns, traced.steps[0][0], attrs)
    for began, ended, info in traced.steps:
        _span("step", parent, began, ended, info)
    _span("reply", parent, traced.steps[-1][1], now, attrs)


def _span(name: str, parent: Any, start: int, end: int, attrs: dict[str, Any]) -> None:
    _tracer.start_span(name, context=parent, start_time=start,
                       attributes=attrs).end(end_time=max(start, end))
