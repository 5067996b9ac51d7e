"""Helpers shared by the Tinker routes: bodies, fields, and ownership checks.

A tenant sees only its own objects: another tenant's id is "not found", as if it did not
exist (no hint that it does).
"""

from __future__ import annotations

import json

from aiohttp import web

from twinkled.service import NotFound, Service, UserError

from .ids import parse_checkpoint_path


def json_payload(encode_obj) -> tuple[bytes, str]:
    return json.dumps(encode_obj).encode(), "application/json"


async def json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise UserError("request body must be a JSON object")
    return body


def field(body: dict, name: str, kind=str):
    if name not in body:
        raise UserError(f"missing field {name!r}")
    value = body[name]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise UserError(f"field {name!r} must be {kind.__name__}")
    return value


def service(request) -> Service:
    return request.app["service"]


def own_session(request, session_id: str) -> dict:
    s = request.app["store"].get_session(session_id)
    if s is None or s["tenant"] != request["tenant"]:
        raise NotFound(f"no session {session_id!r}")
    return s


def own_run(request, run_id: str) -> dict:
    r = request.app["store"].get_run(run_id)
    if r is None or r["tenant"] != request["tenant"] or r.get("deleted"):
        raise NotFound(f"no training run {run_id!r}")
    return r



async def loaded_run(request, run_id: str) -> dict:
    """own_run, with its adapter brought back first if it was unloaded while idle."""
    run = own_run(request, run_id)
    await service(request).ensure_loaded(run)
    return run


def check_base_model(request, name: str | None) -> None:
    served = service(request).config.served_name
    if name is not None and name != served:
        raise UserError(f"base_model {name!r} is not served here; this daemon serves {served!r}")



def future_response(f, model_id=None, **extra):
    body = {"request_id": f.id}
    if model_id:
        body["model_id"] = model_id
    body.update(extra)
    return web.json_response(body)



def own_checkpoint(request, path: str) -> dict:
    try:
        parse_checkpoint_path(path)
    except ValueError as e:
        raise UserError(str(e)) from None
    c = request.app["store"].get_checkpoint(path)
    if c is None or (c["tenant"] != request["tenant"] and not c["public"]):
        raise NotFound(f"no checkpoint {path!r}")
    if c["status"] == "corrupt":  # never served; say why, so the user picks another
        raise UserError(f"checkpoint {path!r} is corrupt and cannot be used: {c['error']}")
    if c["status"] != "ready":
        raise NotFound(f"checkpoint {path!r} is not ready ({c['status']})")
    return c
