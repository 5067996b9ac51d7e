"""Tinker training routes: create a model, forward/backward, optim_step, save and load."""

from __future__ import annotations

import time

from aiohttp import web

from twinkled.service import Op, UserError
from twinkled.store import Conflict, checkpoint_path

from . import codec
from .common import (
    check_base_model,
    field,
    future_response,
    json_body,
    json_payload,
    loaded_run,
    own_checkpoint,
    own_run,
    own_session,
    service,
)
from .ids import valid_name


async def create_model(request):
    from twinkled.engine.types import LoraConfig

    body = await json_body(request)
    s = own_session(request, field(body, "session_id"))
    seq = field(body, "model_seq_id", int)
    check_base_model(request, body.get("base_model"))
    lc = body.get("lora_config") or {}
    opt = (body.get("optimizer_config") or {}).get("type", "adamw")
    if opt != "adamw":
        raise UserError(f"optimizer {opt!r} is not supported; use adamw")
    # The Tinker wire has no alpha; the native SDK sends it as user_metadata.
    meta = body.get("user_metadata") or {}
    try:
        alpha = float(lc.get("alpha", meta.get("twinkle.lora_alpha", 32)))
    except ValueError:
        raise UserError("user_metadata twinkle.lora_alpha must be a number") from None
    config = LoraConfig(rank=int(lc.get("rank", 32)), alpha=alpha,
                        seed=lc.get("seed"), train_attn=bool(lc.get("train_attn", True)),
                        train_mlp=bool(lc.get("train_mlp", True)),
                        train_unembed=bool(lc.get("train_unembed", True)))
    if not 1 <= config.rank <= service(request).config.max_rank:
        raise UserError(f"lora_config.rank must be in 1..{service(request).config.max_rank}")
    service(request).check_new_adapter(request["tenant"], config.rank)
    store = request.app["store"]
    lora = {"rank": config.rank, "alpha": config.alpha, "train_attn": config.train_attn,
            "train_mlp": config.train_mlp, "train_unembed": config.train_unembed,
            "seed": config.seed}
    try:
        model_id = store.create_run(s["id"], request["tenant"], service(request).config.served_name,
                                    config.rank, lora, body.get("user_metadata") or {}, seq)
    except Conflict:
        raise UserError(f"model {s['id']}:train:{seq} already exists") from None
    svc = service(request)
    f = svc.new_future(request["tenant"], "create_model",
                       lambda _: json_payload({"type": "create_model", "model_id": model_id}))
    svc.open_model(model_id, request["tenant"], 0)
    svc.submit(Op("create", model_id, 0, {"adapter_id": model_id, "config": config}, f))
    return future_response(f, model_id)


async def get_info(request):
    body = await json_body(request)
    run = own_run(request, field(body, "model_id"))
    svc = service(request)
    name = svc.config.served_name
    return web.json_response({
        "type": "get_info", "model_id": run["id"],
        "model_data": {"arch": svc.model_info.get("arch"),
                       "model_name": name, "tokenizer_id": str(svc.config.model)},
        "is_lora": True, "lora_rank": run["lora_rank"], "model_name": name,
        "optimizer_config": {"type": "adamw"}})


async def forward_backward(request):
    from twinkled.engine.types import Datum, ForwardBackwardRequest

    try:
        call = codec.decode_forward_backward(await request.read(),
                                             request.headers.get("Content-Encoding"))
    except codec.CodecError as e:
        raise UserError(str(e)) from None
    run = await loaded_run(request, call.model_id)
    svc = service(request)
    data = [Datum(d.tokens, {k: t.values for k, t in d.loss_fn_inputs.items()})
            for d in call.data]
    req = ForwardBackwardRequest(run["id"], data, call.loss_fn, call.loss_fn_config or {},
                                 forward_only=call.forward_only)
    f = svc.new_future(request["tenant"], "forward_backward", codec.fwdbwd_encoder)
    parts = [len(d.tokens) for d in call.data]
    f = svc.submit(Op("fwdbwd", run["id"], call.seq_id, {"request": req, "parts": parts}, f,
                      sum(parts)))
    request.app["store"].touch_run(run["id"])
    return future_response(f, run["id"])


async def optim_step(request):
    from twinkled.engine.types import AdamParams

    body = await json_body(request)
    run = await loaded_run(request, field(body, "model_id"))
    if "adam_params" not in body:
        raise UserError("only adam_params (AdamW) is supported")
    ap = body["adam_params"] or {}
    known = AdamParams.__dataclass_fields__
    params = AdamParams(**{k: float(v) for k, v in ap.items() if k in known})
    svc = service(request)
    f = svc.new_future(request["tenant"], "optim_step",
                       lambda r: json_payload({"type": "optim_step", "metrics": _optim_metrics(r)}))
    f = svc.submit(Op("optim", run["id"], field(body, "seq_id", int),
                      {"adapter_id": run["id"], "params": params}, f))
    return future_response(f, run["id"])


def _optim_metrics(result) -> dict[str, float]:
    return {k: float(v) for k, v in result.metrics.items() if isinstance(v, (int, float))}


def _save(request, run: dict, name: str, kind: str, optimizer: bool, seq_id: int, ttl,
          respond) -> object:
    if not valid_name(name):
        raise UserError(f"checkpoint name {name!r} is invalid (no '/', no '..', not empty)")
    store, svc = request.app["store"], service(request)
    path = checkpoint_path(run["id"], kind, name)
    existing = store.get_checkpoint(path)
    if existing is not None and existing["status"] == "ready" and not respond.get("overwrite"):
        raise UserError(f"checkpoint {path} exists (pass overwrite=True to replace it)")
    directory = svc.config.data_dir / "checkpoints" / run["id"] / kind / name
    expires = time.time() + ttl if ttl else None
    store.begin_checkpoint(run["id"], request["tenant"], kind, name, str(directory),
                           expires_at=expires)

    def after(op, result, message):
        if message is None:
            store.finish_checkpoint(path, *result)
        else:
            store.mark_corrupt(path, message)

    f = svc.new_future(request["tenant"], "save", lambda _: json_payload(respond["body"]))
    return svc.submit(Op("save", run["id"], seq_id, {"adapter_id": run["id"], "dir": directory,
                                                      "optimizer": optimizer, "after": after}, f))


async def save_weights(request):
    body = await json_body(request)
    run = await loaded_run(request, field(body, "model_id"))
    name = field(body, "path")
    path = checkpoint_path(run["id"], "weights", name)
    f = _save(request, run, name, "weights", True, field(body, "seq_id", int),
              body.get("ttl_seconds"), {"overwrite": body.get("overwrite", False),
                                        "body": {"type": "save_weights", "path": path}})
    return future_response(f, run["id"])


async def save_weights_for_sampler(request):
    body = await json_body(request)
    run = await loaded_run(request, field(body, "model_id"))
    seq = field(body, "seq_id", int)
    if body.get("path"):
        name = body["path"]
        path = checkpoint_path(run["id"], "sampler_weights", name)
        f = _save(request, run, name, "sampler_weights", False, seq, body.get("ttl_seconds"),
                  {"overwrite": True, "body": {"type": "save_weights_for_sampler", "path": path}})
        return future_response(f, run["id"])
    # Ephemeral: save a snapshot and hand back a sampling session on it.
    store = request.app["store"]
    session_id = run["session_id"]
    name = f"ephemeral-{seq}"
    path = checkpoint_path(run["id"], "sampler_weights", name)
    sampler_id = store.create_sampler(session_id, request["tenant"],
                                      service(request).config.served_name, path,
                                      body.get("sampling_session_seq_id"))
    f = _save(request, run, name, "sampler_weights", False, seq, 3600,
              {"overwrite": True, "body": {"type": "save_weights_for_sampler",
                                           "sampling_session_id": sampler_id}})
    return future_response(f, run["id"])


async def load_weights(request):
    body = await json_body(request)
    store, svc = request.app["store"], service(request)
    ckpt = own_checkpoint(request, field(body, "path"))
    optimizer = bool(body.get("optimizer", False))
    if "model_id" in body:  # legacy: load into an existing model, in its seq order
        run = await loaded_run(request, body["model_id"])
        seq = field(body, "seq_id", int)
    else:  # create-via-load: the model is "<session>:train:<model_seq_id>", seq 0
        s = own_session(request, field(body, "session_id"))
        src = store.get_run(ckpt["run_id"], include_deleted=True)
        try:
            run_id = store.create_run(s["id"], request["tenant"], svc.config.served_name,
                                      src["lora_rank"], src["lora_config"],
                                      body.get("user_metadata") or {},
                                      field(body, "model_seq_id", int))
        except Conflict:
            raise UserError("that model_seq_id is already used in this session") from None
        run, seq = store.get_run(run_id), 0
        svc.open_model(run_id, request["tenant"], 0)
    f = svc.new_future(request["tenant"], "load_weights",
                       lambda _: json_payload({"type": "load_weights", "path": ckpt["tinker_path"],
                                        "model_id": run["id"]}))
    f = svc.submit(Op("load", run["id"], seq, {"adapter_id": run["id"], "dir": ckpt["dir"],
                                                "optimizer": optimizer}, f))
    return future_response(f, run["id"])



async def weights_info(request):
    body = await json_body(request)
    c = own_checkpoint(request, field(body, "tinker_path"))
    run = request.app["store"].get_run(c["run_id"])
    lc = run["lora_config"]
    return web.json_response({"base_model": run["base_model"], "is_lora": True,
                              "lora_rank": run["lora_rank"], "train_unembed": lc["train_unembed"],
                              "train_mlp": lc["train_mlp"], "train_attn": lc["train_attn"]})
