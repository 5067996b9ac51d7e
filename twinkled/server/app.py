"""The aiohttp application: auth middleware, error mapping, and the routes mounted on it."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import signal
import time
import uuid

from aiohttp import web

from twinkled.core import otel
from twinkled.core.service import Draining, RateLimited, Service
from twinkled.protocol.errors import NotFound, UserError
from twinkled.server import client_metrics, console
from twinkled.server.admin import same_key
from twinkled.server.summary import log_summaries

log = logging.getLogger("twinkled.http")

PUBLIC = {"/api/v1/healthz", "/metrics"}  # scraped without a key, like node exporters
# Download links fetched with plain urllib (no key): each URL carries an expiring signature
# that its route checks instead (tinker_shim/downloads.py, whose PREFIX this is).
SIGNED_PREFIX = "/api/v1/download/"


OAI_PREFIX = "/oai/"  # the OpenAI-compatible face (openai_shim/)
ANTHROPIC_PREFIX = "/anthropic/"  # the Anthropic-compatible face (anthropic_shim/)


def api_key(request: web.Request) -> str:
    """The request's API key: X-API-Key (the Tinker client), or `Authorization: Bearer`
    (what OpenAI clients send)."""
    key = request.headers.get("X-API-Key", "")
    if not key:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            key = token.strip()
    return key


@web.middleware
async def auth_and_errors(request: web.Request, handler):
    """API key -> tenant (401 otherwise); readable 4xx for client faults.

    Never a 5xx/408/409 for a permanent failure: the Tinker client retries those forever.
    """
    started = time.perf_counter()
    request["request_id"] = uuid.uuid4().hex[:12]
    status, reason = 500, ""
    try:
        if request.path.startswith("/admin/"):
            given = request.headers.get("X-Admin-Key", "")
            if not given or not same_key(given, request.app["admin_key"]):
                raise web.HTTPUnauthorized(
                    text='{"detail": "missing or invalid X-Admin-Key"}',
                    content_type="application/json")
            request["tenant"] = "(admin)"
        elif (request.path not in PUBLIC and not request.path.startswith(SIGNED_PREFIX)
              and not console.is_page(request.path)):
            key = api_key(request)
            tenant = request.app["store"].tenants.for_key(key) if key else None
            tenant = tenant or console.admin_tenant(request, key)
            if tenant is None:
                for prefix, body in request.app["unauthorized"].items():
                    if request.path.startswith(prefix):  # in that face's error shape
                        status = 401
                        return web.json_response(body, status=401)
                raise web.HTTPUnauthorized(
                    text='{"detail": "missing or invalid X-API-Key"}',
                    content_type="application/json")
            request["tenant"] = tenant
        response = await handler(request)
        status = response.status
        if status >= 400:
            reason = _reason(getattr(response, "body", None))
        return response
    except web.HTTPException as e:
        status, reason = e.status, _reason(e.text) or e.reason
        raise
    except RateLimited as e:  # the Tinker client backs off and resubmits
        status, reason = 429, str(e)
        return web.json_response({"detail": str(e)}, status=429, headers={"Retry-After": "1"})
    except Draining as e:  # a hot restart: the client retries 503s, and we are back soon
        status, reason = 503, str(e)
        return web.json_response({"detail": str(e)}, status=503, headers={"Retry-After": "2"})
    except NotFound as e:
        status, reason = 404, str(e)
        return web.json_response({"detail": str(e)}, status=404)
    except UserError as e:
        status, reason = 400, str(e)
        return web.json_response({"detail": str(e)}, status=400)
    except ConnectionResetError:
        # The client went away before its request's body was read (a killed client, a
        # dropped network): nobody to answer, and nothing wrong here; logged as nginx's 499
        # (before: a 500 and aiohttp's traceback, which read as a server fault).
        status, reason = 499, "the client closed the connection before its request was read"
        return web.Response(status=499)
    finally:
        ms = round(1000 * (time.perf_counter() - started), 1)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "(unmatched)"
        request.app["service"].metrics.requests.labels(route, str(status)).inc()
        # Health checks and scrapes come every few seconds: logged only at debug level.
        level = logging.DEBUG if request.path in PUBLIC and status < 400 else logging.INFO
        reason = reason[:REASON_CHARS]
        log.log(level, "%s %s %s %s %s %.1fms%s", request["request_id"],
                request.get("tenant", "-"), request.method, request.path, status, ms,
                f": {reason}" if reason else "",
                extra={"request_id": request["request_id"], "tenant": request.get("tenant"),
                       "method": request.method, "route": route, "status": status, "ms": ms,
                       **({"reason": reason} if reason else {})})


REASON_CHARS = 300  # of an error's message in its request's log line


def _reason(body) -> str:
    """What an error response says (Tinker's `detail`, OpenAI's `error.message`)."""
    if isinstance(body, (bytes, bytearray)):
        body = bytes(body[:4096]).decode(errors="replace")
    if not isinstance(body, str) or not body:
        return ""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()
    if isinstance(data, dict):
        err = data.get("error")
        found = data.get("detail") or (err.get("message") if isinstance(err, dict) else err)
        if found:
            return found if isinstance(found, str) else json.dumps(found)
    return body.strip()


def make_app(service: Service, store, admin_key: str = "") -> web.Application:
    from anthropic_shim.errors import UNAUTHORIZED as ANTHROPIC_UNAUTHORIZED
    from anthropic_shim.routes import add_routes as add_anthropic_routes
    from openai_shim.errors import UNAUTHORIZED
    from openai_shim.routes import add_routes as add_openai_routes
    from tinker_shim.routes import add_routes
    from twinkled.server import admin
    from twinkled.server.otel import traced

    if service is not None and not otel.enabled() and otel.wanted(service.config.otel):
        otel.setup()
    middlewares = [traced, auth_and_errors] if otel.enabled() else [auth_and_errors]
    app = web.Application(middlewares=middlewares, client_max_size=service.config.max_body_bytes if service else 64 * 2**20)
    app["service"] = service
    app["store"] = store
    app["admin_key"] = admin_key
    app["unauthorized"] = {OAI_PREFIX: UNAUTHORIZED, ANTHROPIC_PREFIX: ANTHROPIC_UNAUTHORIZED}
    add_routes(app)
    add_openai_routes(app)
    add_anthropic_routes(app)
    admin.routes(app)
    console.add_console_routes(app)
    client_metrics.add_routes(app)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=service.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app.router.add_get("/metrics", metrics)

    async def on_startup(app):
        # SIGUSR2: every task's stack into the log, for an operator (or a test) to see
        # what a daemon that answers but makes no progress is waiting for.
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, _log_tasks)
        await service.life.start()
        if service.config.log_summary_s > 0:
            app["summary"] = asyncio.create_task(
                log_summaries(service.life.status, service.config.log_summary_s))

    async def on_shutdown(app):  # SIGTERM / SIGINT: drain, persist, stop the workers
        if "summary" in app:
            app["summary"].cancel()
        logging.getLogger("twinkled").info(
            "stopping: no new work; queued work drains (up to %g s)",
            service.config.drain_timeout_s)
        await service.life.shutdown()

    async def on_cleanup(app):
        await service.life.close()
        otel.shutdown()  # what is buffered goes out

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


def _log_tasks() -> None:
    out = io.StringIO()
    for task in asyncio.all_tasks():
        task.print_stack(limit=12, file=out)
    logging.getLogger("twinkled").warning("SIGUSR2: the daemon's tasks:\n%s", out.getvalue())
