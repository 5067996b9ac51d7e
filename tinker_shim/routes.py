"""The Tinker API (SDK 0.38) on top of the service: start-up, sessions, futures, and the
route table (training.py, sampling.py and rest.py hold the rest).

Ids follow the SDK's own derivations: a model (training run) is "<session>:train:<n>", a
sampler "<session>:sample:<n>", a checkpoint "tinker://<run>/<kind>/<name>".
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from twinkled.protocol.errors import UserError

from .codec import PROTOBUF
from .common import body_of, metadata, own_session, service
from .json_wire import JSON, json_result, wants_json
from .messages import CreateSession, FinishSession, RetrieveFuture, SessionRef, decode
from .rest import add_rest_routes
from .sampling import asample, create_sampling_session, get_sampler
from .sessions import new_session
from .training import (
    create_model,
    forward,
    forward_backward,
    get_info,
    load_weights,
    optim_step,
    save_weights,
    save_weights_external,
    save_weights_for_sampler,
    weights_info,
)

V1 = "/api/v1"

# -- service, session and start-up -----------------------------------------------------

async def client_config(request):
    # No zstd request bodies: aiohttp would try to decode them itself (it needs an extra
    # package for zstd), and on a local network they save little. pyqwest off keeps the
    # client on plain httpx.
    return web.json_response({"use_pyqwest_transport": False,
                              "proto_compress_fwdbwd": False,
                              "fwdbwd_max_chunk_len": service(request).config.fwdbwd_max_chunk_len})


async def dynamic_config(request):
    return web.json_response({})


async def healthz(request):
    svc = service(request)
    body = {"status": svc.life.health, "model": svc.config.served_name}
    if svc.life.error:
        body["error"] = svc.life.error
    return web.json_response(body)


async def create_session(request):
    body = await body_of(request, CreateSession)
    sid = new_session(request, body, metadata(request, body.user_metadata))
    return web.json_response({"type": "create_session", "session_id": sid})


async def heartbeat(request):
    body = await body_of(request, SessionRef)
    s = own_session(request, body.session_id)
    if s.get("finished_at"):
        raise web.HTTPGone(text='{"detail": "session finished"}', content_type="application/json")
    request.app["store"].sessions.heartbeat(s["id"])
    return web.json_response({"type": "session_heartbeat"})


async def telemetry(request):
    return web.json_response({"status": "accepted"})


async def finish_session(request):
    """End a session: its adapters are unloaded once their queued work has run."""
    s = own_session(request, request.match_info["session_id"])
    try:  # the reason is kept for session search; a body without one still finishes it
        reason = decode(await request.read(), FinishSession).reason
    except (UserError, ConnectionError):  # a client gone mid-body: finished all the same
        reason = None
    service(request).finish_session(request["tenant"], s["id"], reason.type if reason else None)
    return web.Response(status=204)


async def capabilities(request):
    svc = service(request)
    ctx = svc.model_info.get("max_seq_len")
    return web.json_response({"supported_models": [{
        "model_name": svc.config.served_name, "max_context_length": ctx,
        "trainable": True, "sampleable": True}]})


# -- futures -------------------------------------------------------------------------

async def retrieve_future(request):
    body = await body_of(request, RetrieveFuture)
    svc = service(request)
    f = svc.get_future(request["tenant"], body.request_id)
    done, stop = asyncio.ensure_future(f.done.wait()), asyncio.ensure_future(svc.life.polls_stopped())
    await asyncio.wait([done, stop], timeout=svc.config.poll_seconds,
                       return_when=asyncio.FIRST_COMPLETED)
    done.cancel()
    stop.cancel()
    if not f.done.is_set():  # held long enough, or the daemon is stopping: poll again
        body = {"type": "try_again", "request_id": f.id, "queue_state": "active"}
        if svc.is_paused(f.id):
            body.update(queue_state="paused_rate_limit",
                        queue_state_reason="over this tenant's queue quota; it runs as "
                                           "earlier requests finish")
        return web.json_response(body)
    if f.error is not None:
        return web.json_response({"error": f.error[0], "category": f.error[1]})
    if f.content_type == PROTOBUF and wants_json(request.headers.get("Accept")):
        # SDK <= 0.17 reads results as JSON only (json_wire.py)
        payload = json_result(f.kind, f.payload)
        if payload is not None:
            return web.Response(body=payload, content_type=JSON)
    return web.Response(body=f.payload, content_type=f.content_type)


UNSUPPORTED_ROUTES = {
    ("POST", "/create_custom_loss"): "server-side custom losses (traced graphs)",
    ("POST", "/retrieve_futures"): "batched future polling",
    ("POST", "/join_sampling_session"): "joining a sampling session",
    ("POST", "/cancel_future"): "cancelling a future",
    ("POST", "/copy_weights"): "copying weights between projects",
    ("PUT", "/sessions/{session_id}/project"): "projects",
    ("POST", "/auth/token"): "JWT authentication",
    ("GET", "/audit"): "the audit log",
    ("GET", "/billing/usage/events"): "billing usage",
    # Routes of older SDKs (docs/reference.md, "Older tinker SDKs"):
    ("POST", "/unload_model"): "unloading a model (SDK <= 0.25: the server unloads idle "
                               "adapters itself)",
}


def _refuse(what: str):
    async def handler(request):
        raise UserError(f"{what} is not supported by this server")

    return handler


def _tags_future(handler):
    """Record on the store's row of the request's future which run or sampler it belongs
    to (read from the answer's `model_id`), so a session's trace shows its requests.
    (asample tags its own: the sampler is not in its answer.)"""
    async def tagged(request):
        response = await handler(request)
        try:
            body = json.loads(response.body)
        except (TypeError, ValueError):
            return response
        owner = body.get("model_id")
        if owner is not None and body.get("request_id"):
            request.app["service"].tag_future(body["request_id"], owner)
        return response

    return tagged


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get(f"{V1}/healthz", healthz)
    r.add_post(f"{V1}/client/config", client_config)
    r.add_post(f"{V1}/client/dynamic_config", dynamic_config)
    r.add_post(f"{V1}/create_session", create_session)
    r.add_post(f"{V1}/session_heartbeat", heartbeat)
    r.add_post(f"{V1}/telemetry", telemetry)
    r.add_post(f"{V1}/sessions/{{session_id}}/finish", finish_session)
    r.add_get(f"{V1}/get_server_capabilities", capabilities)
    r.add_post(f"{V1}/create_model", _tags_future(create_model))
    r.add_post(f"{V1}/get_info", get_info)
    r.add_post(f"{V1}/forward_backward", _tags_future(forward_backward))
    r.add_post(f"{V1}/forward", _tags_future(forward))
    r.add_post(f"{V1}/optim_step", _tags_future(optim_step))
    r.add_post(f"{V1}/save_weights", _tags_future(save_weights))
    r.add_post(f"{V1}/save_weights_for_sampler", _tags_future(save_weights_for_sampler))
    r.add_post(f"{V1}/save_weights_external", _tags_future(save_weights_external))
    r.add_post(f"{V1}/load_weights", _tags_future(load_weights))
    r.add_post(f"{V1}/weights_info", weights_info)
    r.add_post(f"{V1}/create_sampling_session", create_sampling_session)
    r.add_get(f"{V1}/samplers/{{sampler_id}}", get_sampler)
    r.add_post(f"{V1}/asample", asample)
    r.add_post(f"{V1}/retrieve_future", retrieve_future)
    add_rest_routes(app)
    for (method, path), what in UNSUPPORTED_ROUTES.items():
        r.add_route(method, f"{V1}{path}", _refuse(what))
