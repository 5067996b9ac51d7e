"""The Tinker REST routes (RestClient): training runs, checkpoints and sessions
(downloads.py: signed download URLs; sessions.py: search, traces, storage usage).

A tenant sees only its own objects: anything else is a 404, as if it did not exist.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from twinkled.protocol.checkpoints import checkpoint_path
from twinkled.protocol.checks import check_ttl
from twinkled.protocol.errors import NotFound, UserError
from twinkled.protocol.types import EngineInputError

from .common import iso_time
from .downloads import add_download_routes
from .ids import ALL_KINDS, KINDS
from .messages import SetTtl, decode
from .sessions import add_session_routes, build_trace

V1 = "/api/v1"


def checkpoint_json(c: dict) -> dict:
    return {"checkpoint_id": f"{c['kind']}/{c['name']}",
            "checkpoint_type": ALL_KINDS[c["kind"]], "time": iso_time(c["created"]),
            "tinker_path": c["tinker_path"], "size_bytes": c.get("size_bytes"),
            "public": bool(c.get("public")), "user_metadata": c.get("user_metadata") or None,
            "expires_at": iso_time(c.get("expires_at"))}


def run_json(store, r: dict) -> dict:
    last = {kind: store.checkpoints.latest(r["id"], kind) for kind in KINDS}
    return {"training_run_id": r["id"], "base_model": r["base_model"],
            "model_owner": r["tenant"], "is_lora": True, "corrupted": bool(r.get("corrupted")),
            "lora_rank": r["lora_rank"], "last_request_time": iso_time(r["last_request_time"]),
            "last_checkpoint": last["weights"] and checkpoint_json(last["weights"]),
            "last_sampler_checkpoint": last["sampler_weights"]
            and checkpoint_json(last["sampler_weights"]),
            "user_metadata": r.get("user_metadata") or None}


def _page(request, default_limit: int) -> tuple[int, int]:
    try:
        offset = int(request.query.get("offset", 0))
        limit = int(request.query.get("limit", default_limit))
    except ValueError:
        raise UserError("offset and limit must be integers") from None
    if not 0 <= offset <= 2**62 or not 0 <= limit <= 10_000:
        raise UserError("offset must be >= 0 and limit in 0..10000")
    return offset, limit


def _run(request) -> dict:
    r = request.app["store"].runs.get(request.match_info["run_id"])
    if r is None or r["tenant"] != request["tenant"] or r.get("deleted"):
        raise NotFound(f"no training run {request.match_info['run_id']!r}")
    return r


def _checkpoint(request) -> dict:
    run = _run(request)
    kind_name = request.match_info["checkpoint_id"].split("/")
    if len(kind_name) != 2 or kind_name[0] not in ALL_KINDS:
        raise UserError("checkpoint_id must be weights/<name>, sampler_weights/<name> or "
                        "external_weights/<name>")
    try:
        path = checkpoint_path(run["id"], *kind_name)
    except ValueError as e:  # a name no save could have made ("a..b")
        raise NotFound(f"no checkpoint {request.match_info['checkpoint_id']!r}") from e
    c = request.app["store"].checkpoints.get(path)
    if c is None or c["status"] != "ready":
        raise NotFound(f"no checkpoint {path!r}")
    return c


async def list_runs(request):
    store = request.app["store"]
    offset, limit = _page(request, 20)
    rows, total = store.runs.list(request["tenant"], offset, limit)
    return web.json_response({"training_runs": [run_json(store, r) for r in rows],
                              "cursor": {"offset": offset, "limit": limit, "total_count": total}})


async def get_run(request):
    return web.json_response(run_json(request.app["store"], _run(request)))


async def list_run_checkpoints(request):
    run = _run(request)
    rows, total = request.app["store"].checkpoints.list(run_id=run["id"], offset=0, limit=10_000)
    return web.json_response({"checkpoints": [checkpoint_json(c) for c in rows],
                              "cursor": {"offset": 0, "limit": 10_000, "total_count": total}})


async def list_user_checkpoints(request):
    offset, limit = _page(request, 100)
    rows, total = request.app["store"].checkpoints.list(
        tenant=request["tenant"], offset=offset, limit=limit)
    return web.json_response({"checkpoints": [checkpoint_json(c) for c in rows],
                              "cursor": {"offset": offset, "limit": limit, "total_count": total}})


async def delete_checkpoint(request):
    c = _checkpoint(request)
    request.app["store"].checkpoints.delete(c["tinker_path"])
    # the files go before the answer: an object store's in a thread, off the event loop
    blobs = request.app["service"].blobs
    await asyncio.get_running_loop().run_in_executor(None, blobs.delete, c["dir"], True)
    return web.Response(status=204)


async def publish(request):
    c = _checkpoint(request)
    request.app["store"].checkpoints.set_public(c["tinker_path"], request.method == "POST")
    return web.Response(status=204)


async def set_ttl(request):
    c = _checkpoint(request)
    ttl = decode(await request.read(), SetTtl).ttl_seconds
    try:
        check_ttl("ttl_seconds", ttl, request.app["service"].limits)
    except EngineInputError as e:
        raise UserError(str(e)) from None
    expires_at = None if ttl is None else time.time() + ttl
    request.app["store"].checkpoints.set_expiry(c["tinker_path"], expires_at)
    return web.Response(status=204)


async def list_sessions(request):
    offset, limit = _page(request, 20)
    rows, _ = request.app["store"].sessions.list(request["tenant"], offset, limit)
    return web.json_response({"sessions": [s["id"] for s in rows]})


async def get_session(request):
    store = request.app["store"]
    s = store.sessions.get(request.match_info["session_id"])
    if s is None or s["tenant"] != request["tenant"]:
        raise NotFound(f"no session {request.match_info['session_id']!r}")
    run_ids, sampler_ids = store.sessions.children(s["id"])
    return web.json_response({
        "training_run_ids": run_ids, "sampler_ids": sampler_ids,
        "user_metadata": s.get("user_metadata") or None, "display_name": s.get("display_name")})


def add_rest_routes(app: web.Application) -> None:
    r = app.router
    ckpt = f"{V1}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:.+?}}"
    r.add_get(f"{V1}/training_runs", list_runs)
    r.add_get(f"{V1}/training_runs/{{run_id}}", get_run)
    r.add_get(f"{V1}/training_runs/{{run_id}}/checkpoints", list_run_checkpoints)
    r.add_get(f"{V1}/checkpoints", list_user_checkpoints)
    r.add_post(f"{ckpt}/publish", publish)
    r.add_delete(f"{ckpt}/publish", publish)
    r.add_put(f"{ckpt}/ttl", set_ttl)
    r.add_delete(ckpt, delete_checkpoint)
    r.add_get(f"{V1}/sessions", list_sessions)
    r.add_get(f"{V1}/sessions/{{session_id}}", get_session)
    add_session_routes(app, V1)
    add_download_routes(app, _checkpoint, build_trace, ckpt)
