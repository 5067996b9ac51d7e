"""Helpers shared by the Tinker routes: bodies, fields, and ownership checks.

A tenant sees only its own objects: another tenant's id is "not found", as if it did not
exist (no hint that it does).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from aiohttp import web

from twinkled.core.service import RateLimited, Service
from twinkled.protocol.checks import Limits, check_metadata_size
from twinkled.protocol.config import Config
from twinkled.protocol.errors import NotFound, UserError
from twinkled.protocol.types import EngineInputError

from .ids import KINDS, parse_checkpoint_path
from .messages import decode, encoded_size, seq_ref

M = TypeVar("M")


def iso_time(t) -> str | None:
    """Stored unix seconds (or text) as the ISO datetime REST objects carry."""
    if t is None:
        return None
    if isinstance(t, (int, float)):
        try:
            return datetime.fromtimestamp(t, UTC).isoformat()
        except (OverflowError, ValueError, OSError):  # a far-future expiry of an old row
            return None
    return str(t)


def json_payload(encode_obj) -> tuple[bytes, str]:
    return json.dumps(encode_obj).encode(), "application/json"


async def body_of(request: web.Request, message: type[M]) -> M:
    """The request's JSON body as its typed message (a 400 naming the field otherwise)."""
    return decode(await request.read(), message)


async def seq_body(request: web.Request, message: type[M]) -> M:
    """As `body_of`, for a body with model_id and seq_id: if the rest of it is wrong, the
    refusal still takes its seq_id (the client's later requests count on past it)."""
    raw = await request.read()
    try:
        return decode(raw, message)
    except UserError as e:
        ref = seq_ref(raw)
        if ref is not None:
            try:
                run = await loaded_run(request, ref.model_id)
            except UserError:
                raise e from None
            service(request).refuse(request["tenant"], run["id"], ref.seq_id, str(e))
        raise


def checked(check, *args):
    """Run one of `engine.checks`' rules (or another check that raises EngineInputError)
    and return what it returns: its error is the client's (a 400)."""
    try:
        return check(*args)
    except EngineInputError as e:
        raise UserError(str(e)) from None


def limits(request) -> Limits:
    return service(request).limits


def metadata(request, value: dict | None, where: str = "user_metadata") -> dict:
    """user_metadata, bounded in size (it is stored for good)."""
    if not value:
        return {}
    checked(check_metadata_size, where, encoded_size(value), limits(request))
    return value


@contextmanager
def takes_seq_id(request, run_id: str, seq_id: int | None):
    """Whatever refuses the request inside this block still takes its seq_id, so that the
    client's later requests (which count on past it) do not wait for it forever."""
    try:
        yield
    except RateLimited:  # retried by the client with the same seq_id: nothing taken
        raise
    except UserError as e:
        service(request).refuse(request["tenant"], run_id, seq_id, str(e))
        raise


def service(request) -> Service:
    return request.app["service"]


def own_session(request, session_id: str) -> dict:
    s = request.app["store"].sessions.get(session_id)
    if s is None or s["tenant"] != request["tenant"]:
        raise NotFound(f"no session {session_id!r}")
    return s


def own_run(request, run_id: str) -> dict:
    r = request.app["store"].runs.get(run_id)
    if r is None or r["tenant"] != request["tenant"] or r.get("deleted"):
        raise NotFound(f"no training run {run_id!r}")
    return r



async def loaded_run(request, run_id: str) -> dict:
    """own_run, with its adapter brought back first if it was unloaded while idle."""
    run = own_run(request, run_id)
    await service(request).ensure_loaded(run)
    return run


def check_base_model(request, name: str | None) -> None:
    """A base_model a client names must be the served model: its served name, or the name
    this daemon gives clients to load its tokenizer by (`tokenizer_name`)."""
    svc = service(request)
    served = svc.config.served_name
    if name is not None and name not in (served, tokenizer_name(svc.config)):
        raise UserError(f"base_model {name!r} is not served here; this daemon serves {served!r}")


def tokenizer_name(config: Config) -> str:
    """What `get_info`'s `model_data.tokenizer_id` carries: TrainingClient.get_tokenizer
    calls `AutoTokenizer.from_pretrained` on it, so it must be a Hub id or a directory.

    A served name of the Hub's form (org/model, as `--model-name Qwen/Qwen3-8B` gives) is
    given as it is; otherwise (the default, the directory's bare name) the model directory's
    absolute path, which resolves on a client that sees the same path. Everything else a
    tenant sees names the model by its served name."""
    served = config.served_name
    if served.count("/") == 1 or config.model is None:
        return served
    return str(Path(config.model).resolve())


def future_response(f, model_id=None, **extra):
    body = {"request_id": f.id}
    if model_id:
        body["model_id"] = model_id
    body.update(extra)
    return web.json_response(body)



def own_checkpoint(request, path: str, kinds: dict[str, str] = KINDS) -> dict:
    try:
        parse_checkpoint_path(path, kinds)
    except ValueError as e:
        raise UserError(str(e)) from None
    c = request.app["store"].checkpoints.get(path)
    if c is None or (c["tenant"] != request["tenant"] and not c["public"]):
        raise NotFound(f"no checkpoint {path!r}")
    if c["status"] == "corrupt":  # never served; say why, so the user picks another
        raise UserError(f"checkpoint {path!r} is corrupt and cannot be used: {c['error']}")
    if c["status"] != "ready":
        raise NotFound(f"checkpoint {path!r} is not ready ({c['status']})")
    return c


def sampler_adapter(path: str, checkpoint: dict) -> tuple[str, str]:
    """(adapter id, directory to load it from) of sampling from a checkpoint. Keyed by
    content too: a checkpoint saved again under the same name is new weights."""
    return f"sampler:{path}@{checkpoint['sha256'][:16]}", checkpoint["dir"]
