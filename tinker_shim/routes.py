"""The Tinker API (SDK 0.38) on top of the service: sessions, training, sampling, futures.

Ids follow the SDK's own derivations: a model (training run) is "<session>:train:<n>", a
sampler "<session>:sample:<n>", a checkpoint "tinker://<run>/<kind>/<name>".
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from twinkled.service import NotFound, Op, Service, UserError
from twinkled.store import Conflict, checkpoint_path

from . import codec
from .ids import parse_checkpoint_path, valid_name

V1 = "/api/v1"


def _json(encode_obj) -> tuple[bytes, str]:
    return json.dumps(encode_obj).encode(), "application/json"


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise UserError("request body must be a JSON object")
    return body


def _field(body: dict, name: str, kind=str):
    if name not in body:
        raise UserError(f"missing field {name!r}")
    value = body[name]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise UserError(f"field {name!r} must be {kind.__name__}")
    return value


def _svc(request) -> Service:
    return request.app["service"]


def _own_session(request, session_id: str) -> dict:
    s = request.app["store"].get_session(session_id)
    if s is None or s["tenant"] != request["tenant"]:
        raise NotFound(f"no session {session_id!r}")
    return s


def _own_run(request, run_id: str) -> dict:
    r = request.app["store"].get_run(run_id)
    if r is None or r["tenant"] != request["tenant"] or r.get("deleted"):
        raise NotFound(f"no training run {run_id!r}")
    return r


# -- service, session and start-up -----------------------------------------------------

async def client_config(request):
    # No zstd request bodies: aiohttp would try to decode them itself (it needs an extra
    # package for zstd), and on a local network they save little. pyqwest off keeps the
    # client on plain httpx.
    return web.json_response({"use_pyqwest_transport": False,
                              "proto_compress_fwdbwd": False,
                              "fwdbwd_max_chunk_len": _svc(request).config.fwdbwd_max_chunk_len})


async def dynamic_config(request):
    return web.json_response({})


async def healthz(request):
    svc = _svc(request)
    body = {"status": "ok" if svc.state == "ready" else svc.state,
            "model": svc.config.served_name}
    if svc.load_error:
        body["error"] = svc.load_error
    return web.json_response(body)


async def create_session(request):
    body = await _body(request)
    sid = request.app["store"].create_session(
        request["tenant"], body.get("user_metadata") or {}, body.get("sdk_version"))
    return web.json_response({"type": "create_session", "session_id": sid})


async def heartbeat(request):
    body = await _body(request)
    s = _own_session(request, _field(body, "session_id"))
    if s.get("finished_at"):
        raise web.HTTPGone(text='{"detail": "session finished"}', content_type="application/json")
    request.app["store"].heartbeat(s["id"])
    return web.json_response({"type": "session_heartbeat"})


async def telemetry(request):
    return web.json_response({"status": "accepted"})


async def finish_session(request):
    s = _own_session(request, request.match_info["session_id"])
    request.app["store"].finish_session(s["id"])
    return web.Response(status=204)


async def capabilities(request):
    svc = _svc(request)
    ctx = svc.engine.model.max_seq_len if svc.engine else None
    return web.json_response({"supported_models": [{
        "model_name": svc.config.served_name, "max_context_length": ctx,
        "trainable": True, "sampleable": True}]})


# -- training ------------------------------------------------------------------------

def _check_base_model(request, name: str | None) -> None:
    served = _svc(request).config.served_name
    if name is not None and name != served:
        raise UserError(f"base_model {name!r} is not served here; this daemon serves {served!r}")


def _future_response(f, model_id=None, **extra):
    body = {"request_id": f.id}
    if model_id:
        body["model_id"] = model_id
    body.update(extra)
    return web.json_response(body)


async def create_model(request):
    from twinkled.engine.types import LoraConfig

    body = await _body(request)
    s = _own_session(request, _field(body, "session_id"))
    seq = _field(body, "model_seq_id", int)
    _check_base_model(request, body.get("base_model"))
    lc = body.get("lora_config") or {}
    opt = (body.get("optimizer_config") or {}).get("type", "adamw")
    if opt != "adamw":
        raise UserError(f"optimizer {opt!r} is not supported; use adamw")
    config = LoraConfig(rank=int(lc.get("rank", 32)), alpha=float(lc.get("alpha", 32)),
                        seed=lc.get("seed"), train_attn=bool(lc.get("train_attn", True)),
                        train_mlp=bool(lc.get("train_mlp", True)),
                        train_unembed=bool(lc.get("train_unembed", True)))
    if not 1 <= config.rank <= _svc(request).config.max_rank:
        raise UserError(f"lora_config.rank must be in 1..{_svc(request).config.max_rank}")
    _svc(request).check_new_adapter(request["tenant"], config.rank)
    store = request.app["store"]
    lora = {"rank": config.rank, "alpha": config.alpha, "train_attn": config.train_attn,
            "train_mlp": config.train_mlp, "train_unembed": config.train_unembed,
            "seed": config.seed}
    try:
        model_id = store.create_run(s["id"], request["tenant"], _svc(request).config.served_name,
                                    config.rank, lora, body.get("user_metadata") or {}, seq)
    except Conflict:
        raise UserError(f"model {s['id']}:train:{seq} already exists") from None
    svc = _svc(request)
    f = svc.new_future(request["tenant"], "create_model",
                       lambda _: _json({"type": "create_model", "model_id": model_id}))
    svc.open_model(model_id, request["tenant"], 0)
    svc.submit(Op("create", model_id, 0, {"adapter_id": model_id, "config": config}, f))
    return _future_response(f, model_id)


async def get_info(request):
    body = await _body(request)
    run = _own_run(request, _field(body, "model_id"))
    svc = _svc(request)
    name = svc.config.served_name
    return web.json_response({
        "type": "get_info", "model_id": run["id"],
        "model_data": {"arch": svc.engine.model.config.model_type if svc.engine else None,
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
    run = _own_run(request, call.model_id)
    svc = _svc(request)
    data = [Datum(d.tokens, {k: t.values for k, t in d.loss_fn_inputs.items()})
            for d in call.data]
    req = ForwardBackwardRequest(run["id"], data, call.loss_fn, call.loss_fn_config or {},
                                 forward_only=call.forward_only)
    f = svc.new_future(request["tenant"], "forward_backward", codec.fwdbwd_encoder)
    parts = [len(d.tokens) for d in call.data]
    f = svc.submit(Op("fwdbwd", run["id"], call.seq_id, {"request": req, "parts": parts}, f,
                      sum(parts)))
    request.app["store"].touch_run(run["id"])
    return _future_response(f, run["id"])


async def optim_step(request):
    from twinkled.engine.types import AdamParams

    body = await _body(request)
    run = _own_run(request, _field(body, "model_id"))
    if "adam_params" not in body:
        raise UserError("only adam_params (AdamW) is supported")
    ap = body["adam_params"] or {}
    known = AdamParams.__dataclass_fields__
    params = AdamParams(**{k: float(v) for k, v in ap.items() if k in known})
    svc = _svc(request)
    f = svc.new_future(request["tenant"], "optim_step",
                       lambda r: _json({"type": "optim_step", "metrics": _optim_metrics(r)}))
    f = svc.submit(Op("optim", run["id"], _field(body, "seq_id", int),
                      {"adapter_id": run["id"], "params": params}, f))
    return _future_response(f, run["id"])


def _optim_metrics(result) -> dict[str, float]:
    return {k: float(v) for k, v in result.metrics.items() if isinstance(v, (int, float))}


def _save(request, run: dict, name: str, kind: str, optimizer: bool, seq_id: int, ttl,
          respond) -> object:
    if not valid_name(name):
        raise UserError(f"checkpoint name {name!r} is invalid (no '/', no '..', not empty)")
    store, svc = request.app["store"], _svc(request)
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

    f = svc.new_future(request["tenant"], "save", lambda _: _json(respond["body"]))
    return svc.submit(Op("save", run["id"], seq_id, {"adapter_id": run["id"], "dir": directory,
                                                      "optimizer": optimizer, "after": after}, f))


async def save_weights(request):
    body = await _body(request)
    run = _own_run(request, _field(body, "model_id"))
    name = _field(body, "path")
    path = checkpoint_path(run["id"], "weights", name)
    f = _save(request, run, name, "weights", True, _field(body, "seq_id", int),
              body.get("ttl_seconds"), {"overwrite": body.get("overwrite", False),
                                        "body": {"type": "save_weights", "path": path}})
    return _future_response(f, run["id"])


async def save_weights_for_sampler(request):
    body = await _body(request)
    run = _own_run(request, _field(body, "model_id"))
    seq = _field(body, "seq_id", int)
    if body.get("path"):
        name = body["path"]
        path = checkpoint_path(run["id"], "sampler_weights", name)
        f = _save(request, run, name, "sampler_weights", False, seq, body.get("ttl_seconds"),
                  {"overwrite": True, "body": {"type": "save_weights_for_sampler", "path": path}})
        return _future_response(f, run["id"])
    # Ephemeral: save a snapshot and hand back a sampling session on it.
    store = request.app["store"]
    session_id = run["session_id"]
    name = f"ephemeral-{seq}"
    path = checkpoint_path(run["id"], "sampler_weights", name)
    sampler_id = store.create_sampler(session_id, request["tenant"],
                                      _svc(request).config.served_name, path,
                                      body.get("sampling_session_seq_id"))
    f = _save(request, run, name, "sampler_weights", False, seq, 3600,
              {"overwrite": True, "body": {"type": "save_weights_for_sampler",
                                           "sampling_session_id": sampler_id}})
    return _future_response(f, run["id"])


async def load_weights(request):
    body = await _body(request)
    store, svc = request.app["store"], _svc(request)
    ckpt = _own_checkpoint(request, _field(body, "path"))
    optimizer = bool(body.get("optimizer", False))
    if "model_id" in body:  # legacy: load into an existing model, in its seq order
        run = _own_run(request, body["model_id"])
        seq = _field(body, "seq_id", int)
    else:  # create-via-load: the model is "<session>:train:<model_seq_id>", seq 0
        s = _own_session(request, _field(body, "session_id"))
        src = store.get_run(ckpt["run_id"], include_deleted=True)
        try:
            run_id = store.create_run(s["id"], request["tenant"], svc.config.served_name,
                                      src["lora_rank"], src["lora_config"],
                                      body.get("user_metadata") or {},
                                      _field(body, "model_seq_id", int))
        except Conflict:
            raise UserError("that model_seq_id is already used in this session") from None
        run, seq = store.get_run(run_id), 0
        svc.open_model(run_id, request["tenant"], 0)
    f = svc.new_future(request["tenant"], "load_weights",
                       lambda _: _json({"type": "load_weights", "path": ckpt["tinker_path"],
                                        "model_id": run["id"]}))
    f = svc.submit(Op("load", run["id"], seq, {"adapter_id": run["id"], "dir": ckpt["dir"],
                                                "optimizer": optimizer}, f))
    return _future_response(f, run["id"])


def _own_checkpoint(request, path: str) -> dict:
    try:
        parse_checkpoint_path(path)
    except ValueError as e:
        raise UserError(str(e)) from None
    c = request.app["store"].get_checkpoint(path)
    if c is None or c["status"] != "ready" or (c["tenant"] != request["tenant"] and not c["public"]):
        raise NotFound(f"no checkpoint {path!r}")
    return c


async def weights_info(request):
    body = await _body(request)
    c = _own_checkpoint(request, _field(body, "tinker_path"))
    run = request.app["store"].get_run(c["run_id"])
    lc = run["lora_config"]
    return web.json_response({"base_model": run["base_model"], "is_lora": True,
                              "lora_rank": run["lora_rank"], "train_unembed": lc["train_unembed"],
                              "train_mlp": lc["train_mlp"], "train_attn": lc["train_attn"]})


# -- sampling ------------------------------------------------------------------------

async def create_sampling_session(request):
    body = await _body(request)
    s = _own_session(request, _field(body, "session_id"))
    store = request.app["store"]
    path = body.get("model_path")
    if path:
        _own_checkpoint(request, path)
    else:
        _check_base_model(request, body.get("base_model"))
    try:
        sampler_id = store.create_sampler(s["id"], request["tenant"],
                                          _svc(request).config.served_name, path,
                                          body.get("sampling_session_seq_id"))
    except Conflict:
        raise UserError("that sampling_session_seq_id is already used") from None
    return web.json_response({"type": "create_sampling_session", "sampling_session_id": sampler_id})


def _own_sampler(request, sampler_id: str) -> dict:
    s = request.app["store"].get_sampler(sampler_id)
    if s is None or s["tenant"] != request["tenant"]:
        raise NotFound(f"no sampler {sampler_id!r}")
    return s


async def get_sampler(request):
    s = _own_sampler(request, request.match_info["sampler_id"])
    body = {"sampler_id": s["id"], "base_model": s["base_model"]}
    if s.get("model_path"):
        body["model_path"] = s["model_path"]
    return web.json_response(body)


UNSUPPORTED_SAMPLE = {"topk_prompt_logprobs": "top-k prompt logprobs",
                      "topk_sample_logprobs": "top-k sample logprobs",
                      "prompt_alt_tokens_k": "prompt alternative tokens",
                      "target_prompt_logprobs": "target prompt logprobs",
                      "record_stability_info": "stability info (stable_reinforce)",
                      "prompt_logprobs_last_n": "a window of prompt logprobs"}


async def asample(request):
    from twinkled.engine.types import SampleRequest, SamplingParams

    body = await _body(request)
    sampler = _own_sampler(request, _field(body, "sampling_session_id"))
    for key, what in UNSUPPORTED_SAMPLE.items():
        if body.get(key):
            raise UserError(f"{what} ({key}) is not supported by this server")
    tokens = _prompt_tokens(body.get("prompt"))
    sp = body.get("sampling_params") or {}
    params = SamplingParams(max_tokens=int(sp.get("max_tokens") or 16),
                            temperature=float(sp.get("temperature", 1.0)),
                            top_k=int(sp.get("top_k", -1)), top_p=float(sp.get("top_p", 1.0)),
                            seed=sp.get("seed"), stop=sp.get("stop"))
    if isinstance(params.stop, str):
        params.stop = [params.stop]
    n = int(body.get("num_samples", 1))
    path = sampler.get("model_path")
    adapter = None
    args = {}
    if path:
        c = _own_checkpoint(request, path)
        # Keyed by content too: a checkpoint saved again under the same name is new weights.
        adapter = f"sampler:{path}@{c['sha256'][:16]}"
        args = {"adapter_id": adapter, "load_from": c["dir"]}
    req = SampleRequest(adapter, tokens, params, n, bool(body.get("prompt_logprobs", False)))
    svc = _svc(request)
    f = svc.new_future(request["tenant"], "sample", codec.sample_encoder)
    tokens = len(tokens) + params.max_tokens * n
    svc.submit(Op("sample", None, None, {"request": req, **args}, f, tokens))
    seq = body.get("seq_id", 0)
    ids = [f"{sampler['id']}:{seq}:{i}" for i in range(n)]
    return _future_response(f, sample_sequence_ids=ids)


def _prompt_tokens(prompt) -> list[int]:
    """ModelInput JSON -> token ids; only text chunks are supported."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise UserError("prompt must be a ModelInput: {'chunks': [...]}")
    tokens: list[int] = []
    for chunk in prompt["chunks"]:
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise UserError(f"prompt chunks of type {kind!r} are not supported (text only)")
        if not all(isinstance(t, int) for t in chunk.get("tokens", [])):
            raise UserError("prompt tokens must be integers")
        tokens.extend(chunk["tokens"])
    return tokens


# -- futures -------------------------------------------------------------------------

async def retrieve_future(request):
    body = await _body(request)
    svc = _svc(request)
    f = svc.get_future(request["tenant"], _field(body, "request_id"))
    try:
        await asyncio.wait_for(f.done.wait(), timeout=svc.config.poll_seconds)
    except TimeoutError:
        body = {"type": "try_again", "request_id": f.id, "queue_state": "active"}
        if svc.is_paused(f.id):
            body.update(queue_state="paused_rate_limit",
                        queue_state_reason="over this tenant's queue quota; it runs as "
                                           "earlier requests finish")
        return web.json_response(body)
    if f.error is not None:
        return web.json_response({"error": f.error[0], "category": f.error[1]})
    return web.Response(body=f.payload, content_type=f.content_type)


UNSUPPORTED_ROUTES = {
    ("POST", "/save_weights_external"): "exporting external (merged HF) weights",
    ("GET", "/training_runs/{run_id}/checkpoints/{checkpoint_id:.+?}/external_weights_urls"):
        "download URLs for external weights",
    ("POST", "/create_custom_loss"): "server-side custom losses (traced graphs)",
    ("POST", "/retrieve_futures"): "batched future polling",
    ("POST", "/join_sampling_session"): "joining a sampling session",
    ("POST", "/cancel_future"): "cancelling a future",
    ("POST", "/copy_weights"): "copying weights between projects",
    ("POST", "/sessions/search"): "session search",
    ("GET", "/sessions/{session_id}/trace_export"): "session trace export",
    ("PUT", "/sessions/{session_id}/project"): "projects",
    ("POST", "/auth/token"): "JWT authentication",
}


def _refuse(what: str):
    async def handler(request):
        raise UserError(f"{what} is not supported by this server")

    return handler


def add_routes(app: web.Application) -> None:
    from .rest import add_rest_routes

    r = app.router
    r.add_get(f"{V1}/healthz", healthz)
    r.add_post(f"{V1}/client/config", client_config)
    r.add_post(f"{V1}/client/dynamic_config", dynamic_config)
    r.add_post(f"{V1}/create_session", create_session)
    r.add_post(f"{V1}/session_heartbeat", heartbeat)
    r.add_post(f"{V1}/telemetry", telemetry)
    r.add_post(f"{V1}/sessions/{{session_id}}/finish", finish_session)
    r.add_get(f"{V1}/get_server_capabilities", capabilities)
    r.add_post(f"{V1}/create_model", create_model)
    r.add_post(f"{V1}/get_info", get_info)
    r.add_post(f"{V1}/forward_backward", forward_backward)
    r.add_post(f"{V1}/optim_step", optim_step)
    r.add_post(f"{V1}/save_weights", save_weights)
    r.add_post(f"{V1}/save_weights_for_sampler", save_weights_for_sampler)
    r.add_post(f"{V1}/load_weights", load_weights)
    r.add_post(f"{V1}/weights_info", weights_info)
    r.add_post(f"{V1}/create_sampling_session", create_sampling_session)
    r.add_get(f"{V1}/samplers/{{sampler_id}}", get_sampler)
    r.add_post(f"{V1}/asample", asample)
    r.add_post(f"{V1}/retrieve_future", retrieve_future)
    add_rest_routes(app)
    for (method, path), what in UNSUPPORTED_ROUTES.items():
        r.add_route(method, f"{V1}{path}", _refuse(what))
