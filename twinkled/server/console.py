"""The web console: a page the daemon serves at /console/ and the JSON it draws from.

The page (console_static/: plain HTML, CSS and a small script that draws its curves as SVG;
nothing fetched from elsewhere) asks for an API key once and sends it as `X-API-Key` to the
JSON routes under /console/api/. A tenant's key sees that tenant's runs, checkpoints and
sessions, and its own row of the scheduler's shares; the admin key (`<data_dir>/admin.key`)
sees every tenant's, and the operator view (lanes, devices and their memory, queues,
shares, adapter tiers). Another tenant's run is simply not found (404), as on the other
routes. Every URL the page uses is relative, so it works behind a reverse proxy that
serves the daemon under a path prefix.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from urllib.parse import quote

from aiohttp import web

from tinker_shim.downloads import PREFIX as DOWNLOAD_PREFIX
from tinker_shim.downloads import URL_TTL_S, archive_subject, download_key, sign
from twinkled.protocol.errors import NotFound
from twinkled.server.admin import same_key

log = logging.getLogger("twinkled.console")
PAGE_PREFIX = "/console/"  # the page and its files: no key needed to load them
API_PREFIX = "/console/api/"  # the JSON: a tenant's key or the admin key
ADMIN = "(admin)"  # request["tenant"] of a console request made with the admin key
STATIC = Path(__file__).with_name("console_static")
MAX_ROWS = 1000  # runs or sessions listed at once


def is_page(path: str) -> bool:
    """A console file (public: it holds no data, the page asks for a key)."""
    return path == PAGE_PREFIX[:-1] or (path.startswith(PAGE_PREFIX)
                                        and not path.startswith(API_PREFIX))


def admin_tenant(request: web.Request, key: str) -> str | None:
    """ADMIN when a console JSON request carries the admin key (else None): the console is
    the one face outside /admin/ where the admin key is taken, and only for reading."""
    if key and request.path.startswith(API_PREFIX) and same_key(key, request.app["admin_key"]):
        return ADMIN
    return None


def _viewer(request: web.Request) -> str | None:
    """The tenant whose rows the request sees, None for the admin (every tenant's)."""
    tenant = request["tenant"]
    return None if tenant == ADMIN else tenant


def _signed(request: web.Request, route: str, subject: str) -> str:
    """A download URL (tinker_shim/downloads.py), relative to the console's page so that a
    path prefix in front of the daemon is kept."""
    expires = int(time.time()) + URL_TTL_S
    sig = sign(download_key(request.app["service"].config.data_dir), subject, expires)
    return f"..{DOWNLOAD_PREFIX}{route}?expires={expires}&sig={sig}"


def _q(part: str) -> str:
    return quote(part, safe=":@+=,")


def _checkpoint(request: web.Request, c: dict) -> dict:
    row = {k: c.get(k) for k in ("tinker_path", "kind", "name", "status", "size_bytes",
                                 "sha256", "created", "expires_at", "public")}
    if c["status"] == "ready":  # a tar of its PEFT files, as `tinker checkpoint download` gets
        route = "/".join(_q(p) for p in ("archives", c["run_id"], c["kind"], c["name"]))
        row["download"] = _signed(request, f"{route}/checkpoint.tar", archive_subject(c))
    return row


# -- what the routes answer -------------------------------------------------------------

async def me(request: web.Request) -> web.Response:
    viewer = _viewer(request)
    service = request.app["service"]
    return web.json_response({"tenant": viewer, "admin": viewer is None,
                              "model": service.config.served_name, "state": service.life.state})


async def runs(request: web.Request) -> web.Response:
    store = request.app["store"]
    rows = store.runs.all(_viewer(request), MAX_ROWS)
    counts = store.steps.counts([r["id"] for r in rows])
    return web.json_response({"runs": [
        {k: r[k] for k in ("id", "tenant", "session_id", "base_model", "lora_rank", "created",
                           "last_request_time", "live", "corrupted")}
        | {"steps": counts.get(r["id"], 0)} for r in rows]})


def _own_run(request: web.Request) -> dict:
    run_id = request.match_info["run_id"]
    run = request.app["store"].runs.get(run_id)
    viewer = _viewer(request)
    if run is None or (viewer is not None and run["tenant"] != viewer):
        raise NotFound(f"no training run {run_id!r}")
    return run


async def run(request: web.Request) -> web.Response:
    """A run, its steps (the curves' points), what its client reported of it
    (client_metrics.py) and its checkpoints."""
    r = _own_run(request)
    store = request.app["store"]
    checkpoints, _ = store.checkpoints.list(run_id=r["id"], limit=MAX_ROWS, status=None)
    return web.json_response({
        "run": {k: r[k] for k in ("id", "tenant", "session_id", "base_model", "lora_rank",
                                  "lora_config", "created", "last_request_time", "live",
                                  "corrupted", "user_metadata")},
        "steps": store.steps.of_run(r["id"]),
        "client_metrics": store.client_metrics.of_run(r["id"]),
        "checkpoints": [_checkpoint(request, c) for c in checkpoints]})


async def samples(request: web.Request) -> web.Response:
    """The run's last sampling calls (core/recent_samples.py), newest first, the token ids
    decoded with the model's tokenizer (off the event loop); a tenant sees its own calls."""
    r = _own_run(request)
    calls = request.app["service"].recent_samples.of_run(r["id"], _viewer(request))
    if calls:
        try:
            side = await request.app["oai_text"].get()
        except Exception as e:  # noqa: BLE001 - a model without a usable tokenizer: ids only
            log.warning("console: no tokenizer to decode samples with: %s", e)
        else:
            await side.off_loop(_decode, side.decode, calls)
    return web.json_response({"samples": calls})


def _decode(decode, calls: list[dict]) -> None:
    for c in calls:
        c["prompt_text"] = decode(c["prompt"])
        for s in c["sequences"]:
            s["text"] = decode(s["tokens"])


async def sessions(request: web.Request) -> web.Response:
    """Sessions (newest first), each with its runs, samplers and a link to its trace."""
    store = request.app["store"]
    viewer = _viewer(request)
    tenants = [viewer] if viewer is not None else [t["name"] for t in store.tenants.list()]
    rows = [s for t in tenants for s in store.sessions.list(t, 0, MAX_ROWS)[0]]
    rows.sort(key=lambda s: s["created"], reverse=True)
    out = []
    for s in rows[:MAX_ROWS]:
        run_ids, sampler_ids = store.sessions.children(s["id"])
        out.append({k: s.get(k) for k in ("id", "tenant", "created", "last_heartbeat",
                                          "finished_at", "finish_reason", "sdk_version",
                                          "display_name")}
                   | {"runs": run_ids, "samplers": sampler_ids,
                      "trace": _signed(request, f"sessions/{_q(s['id'])}/trace.json",
                                       f"trace\n{s['id']}")})
    return web.json_response({"sessions": out})


async def operator(request: web.Request) -> web.Response:
    """The daemon's status (`ctl status --json`) for the admin; a tenant sees the model,
    its state and its own row of the shares."""
    status = request.app["service"].life.status()
    viewer = _viewer(request)
    if viewer is not None:
        own = status.get("tenants", {}).get(viewer)
        status = {k: status.get(k) for k in ("model", "state", "time")}
        status["tenants"] = {viewer: own} if own is not None else {}
    return web.json_response(status)


async def page(request: web.Request) -> web.StreamResponse:
    """The console's files; /console (no slash) goes to /console/ (relative, for proxies)."""
    name = request.match_info.get("name") or "index.html"
    path = (STATIC / name).resolve()
    if path.parent != STATIC.resolve() or not path.is_file():
        raise web.HTTPNotFound(text='{"detail": "no such console file"}',
                               content_type="application/json")
    # The page's own files change only with the daemon: no caching across upgrades
    return web.FileResponse(path, headers={"Cache-Control": "no-cache"})


async def to_page(request: web.Request) -> web.Response:
    raise web.HTTPFound("console/")


def add_console_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/console", to_page)
    r.add_get(PAGE_PREFIX, page)
    r.add_get(API_PREFIX + "me", me)
    r.add_get(API_PREFIX + "runs", runs)
    r.add_get(API_PREFIX + "runs/{run_id}", run)
    r.add_get(API_PREFIX + "runs/{run_id}/samples", samples)
    r.add_get(API_PREFIX + "sessions", sessions)
    r.add_get(API_PREFIX + "operator", operator)
    r.add_get(PAGE_PREFIX + "{name}", page)
