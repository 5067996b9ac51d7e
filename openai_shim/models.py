"""What a request's `model` names: the served base model, or sampler weights the key may
read, and the list `GET /models` gives.

A sampler path is a checkpoint path as Tinker hands them out
(`tinker://<run>/sampler_weights/<name>` from save_weights_for_sampler) or a sampling
session's id (`<session>:sample:<n>`, optionally as `tinker://<session>:sample:<n>`, from
save_weights_and_get_sampling_client). Access goes through the Tinker face's own checks
(`own_checkpoint`, the sampler's owner): another tenant's path is "not found", like an
unknown one.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from tinker_shim.common import own_checkpoint, sampler_adapter, service, tokenizer_name
from twinkled.protocol.errors import NotFound, UserError

from .errors import bad_param, model_not_found

SCHEMES = ("tinker://", "twinkle://")


@dataclass(frozen=True)
class Target:
    owner: str  # what the sample is recorded under: the checkpoint path or the base name
    adapter: str | None = None  # None: the base model
    load_from: str | None = None


def resolve(request: web.Request, name: str) -> Target:
    svc = service(request)
    served = svc.config.served_name
    if name in (served, tokenizer_name(svc.config)):
        return Target(served)
    bare = next((name[len(s):] for s in SCHEMES if name.startswith(s)), name)
    path = name
    if "/" not in bare and ":sample:" in bare:  # a sampling session
        s = request.app["store"].samplers.get(bare)
        if s is None or s["tenant"] != request["tenant"]:
            raise model_not_found(name)
        if not s.get("model_path"):
            return Target(served)
        path = s["model_path"]
    elif bare == name:
        raise model_not_found(name)
    try:
        c = own_checkpoint(request, path)
    except NotFound:
        raise model_not_found(name) from None
    except UserError as e:  # not a checkpoint path, or a corrupt checkpoint
        raise bad_param("model", str(e)) from None
    adapter, load_from = sampler_adapter(path, c)
    return Target(path, adapter, load_from)


def listing(request: web.Request, limit: int = 1000) -> dict:
    """The served model, then the tenant's ready sampler weights, newest first."""
    svc = service(request)
    data = [{"id": svc.config.served_name, "object": "model", "created": 0,
             "owned_by": "twinkled"}]
    rows, _ = request.app["store"].checkpoints.list(tenant=request["tenant"], limit=limit)
    for c in rows:
        if c["kind"] == "sampler_weights":
            data.append({"id": c["tinker_path"], "object": "model",
                         "created": int(c["created"] or 0), "owned_by": request["tenant"],
                         "root": svc.config.served_name, "parent": svc.config.served_name})
    return {"object": "list", "data": data}


def one(request: web.Request, name: str) -> dict:
    """`GET /models/{model}`: the listing's entry of that id (the served model, or the
    caller's own ready sampler weights), else a 404 as OpenAI gives."""
    found = next((m for m in listing(request)["data"] if m["id"] == name), None)
    if found is None:
        raise model_not_found(name)
    return found
