"""Tinker training routes: create a model, forward/backward, optim_step, save and load."""

from __future__ import annotations

import asyncio
import math
import secrets

import msgspec
from aiohttp import web

from twinkled.protocol.checks import (
    RECORDED_INPUTS,
    check_datum,
    check_loss,
    check_name,
    check_optim_params,
    check_optimizer,
    check_rank,
    check_ttl,
)
from twinkled.protocol.errors import UserError
from twinkled.protocol.frames import DatumF, OptimF, TrainF, buf
from twinkled.protocol.types import AdamParams, DimuonParams, LoraConfig

from . import codec, json_wire, output_codec
from . import images as tinker_images
from .common import (
    body_of,
    check_base_model,
    checked,
    future_response,
    json_payload,
    limits,
    loaded_run,
    metadata,
    own_checkpoint,
    own_run,
    own_session,
    seq_body,
    service,
    takes_seq_id,
    tokenizer_name,
)
from .ids import ALL_KINDS
from .messages import (
    CheckpointRef,
    CreateModel,
    LoadWeights,
    ModelRef,
    OptimizerConfigIn,
    OptimStep,
    SaveWeights,
)


async def create_model(request):
    body = await body_of(request, CreateModel)
    s = own_session(request, body.session_id)
    check_base_model(request, body.base_model)
    opt = _optimizer(body.optimizer_config)
    meta = metadata(request, body.user_metadata)
    lc = body.lora_config
    if lc.rank != 0:  # 0: a full-parameter run, which the service admits or refuses
        checked(check_rank, lc.rank, limits(request))
    # A seed always: a restore that must re-create the adapter gets the same weights.
    seed = lc.seed if lc.seed is not None else secrets.randbits(62)
    config = LoraConfig(rank=lc.rank, alpha=_alpha(meta), seed=seed,
                        train_attn=lc.train_attn, train_mlp=lc.train_mlp,
                        train_unembed=lc.train_unembed, optimizer=opt)
    model_id, f = service(request).create_model(
        request["tenant"], s["id"], body.model_seq_id, config, meta,
        lambda model: json_payload({"type": "create_model", "model_id": model}))
    return future_response(f, model_id)


def _optimizer(cfg: OptimizerConfigIn | None) -> str:
    """Tinker's `optimizer_config`: {"type": "adamw"} (the default) or {"type": "dimuon",
    "version": 1}, fixed for the model's life."""
    if cfg is None:
        return "adamw"
    checked(check_optimizer, cfg.type)
    if cfg.type == "dimuon" and cfg.version not in (None, 1):
        raise UserError(f"optimizer_config.version: Dimuon version {cfg.version} is not "
                        "supported; use 1")
    return cfg.type


def _run_optimizer(run: dict) -> str:
    """The optimizer family a run was created with (runs from before Dimuon: AdamW)."""
    return (run["lora_config"] or {}).get("optimizer", "adamw")


def _optimizer_config(run: dict) -> dict:
    """The run's optimizer_config as the SDK's types read it back (get_info, weights_info)."""
    opt = _run_optimizer(run)
    return {"type": "dimuon", "version": 1} if opt == "dimuon" else {"type": opt}


def _alpha(meta: dict) -> float:
    """The Tinker wire has no alpha; the native SDK sends it as user_metadata."""
    value = meta.get("twinkle.lora_alpha", 32)
    try:
        alpha = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        alpha = math.nan
    if not 0 < alpha <= 1e6:
        raise UserError("user_metadata.twinkle.lora_alpha must be a number in (0, 1e6], got "
                        f"{value!r}")
    return alpha


async def get_info(request):
    body = await body_of(request, ModelRef)
    run = own_run(request, body.model_id)
    svc = service(request)
    name = svc.config.served_name
    # Names, never the server's paths, for what a tenant sees (a sampler made by
    # save_weights_and_get_sampling_client takes model_data.model_name as its base model).
    # TrainingClient.get_tokenizer loads by tokenizer_id: that one must resolve on the
    # client, so it is the hub id or the model directory (common.tokenizer_name).
    return web.json_response({
        "type": "get_info", "model_id": run["id"],
        "model_data": {"arch": svc.model_info.get("arch"),
                       "model_name": name, "tokenizer_id": tokenizer_name(svc.config)},
        "is_lora": True, "lora_rank": run["lora_rank"], "model_name": name,
        "optimizer_config": _optimizer_config(run)})


async def forward_backward(request):
    """The protobuf body of SDK >= 0.25, or the JSON one of older SDKs, by its Content-Type."""
    return await _train(request, forward_only=None)


async def forward(request):
    """POST /api/v1/forward: SDK <= 0.24's forward pass, JSON only."""
    return await _train(request, forward_only=True)


def _decode_call(raw: bytes, request, forward_only: bool | None) -> codec.FwdBwdCall:
    limit = service(request).config.max_body_bytes
    encoding = request.headers.get("Content-Encoding")
    if forward_only is None and request.content_type != json_wire.JSON:
        return codec.decode_forward_backward(raw, encoding, max_decompressed_bytes=limit)
    return json_wire.decode_json_forward(codec.decompress(raw, encoding, limit),
                                         bool(forward_only))


async def _train(request, forward_only: bool | None):
    svc = service(request)
    try:
        call = _decode_call(await request.read(), request, forward_only)
    except codec.CodecError as e:
        if e.model_id:  # the envelope was read: the refusal takes its seq_id
            run = await loaded_run(request, e.model_id)
            svc.refuse(request["tenant"], run["id"], e.seq_id, str(e))
        raise UserError(str(e)) from None
    run = await loaded_run(request, call.model_id)
    with takes_seq_id(request, run["id"], call.seq_id):
        lim = limits(request)
        if len(call.data) > lim.max_datums:
            raise UserError(f"data: {len(call.data)} datums in one request; at most "
                            f"{lim.max_datums} (send fewer, or raise max_datums)")
        images = [[] for _ in call.data]
        if any(d.images for d in call.data):  # decoded off the event loop
            expanded, images = await asyncio.to_thread(
                tinker_images.expand, call.data, svc.config, run["base_model"])
            call = msgspec.structs.replace(call, data=expanded)
        checked(check_loss, call.loss_fn, call.loss_fn_config)
        data = []
        for j, d in enumerate(call.data):
            tensors = dict(d.loss_fn_inputs)
            if call.loss_fn == "stable_reinforce":
                tensors.update(_recorded_inputs(request, run, j, d))
            inputs = {k: (t.shape, t.values) for k, t in tensors.items()}
            checked(check_datum, j, d.tokens, inputs, call.loss_fn, lim)
            data.append(DatumF(buf(d.tokens, "int64"), {k: buf(t.values, t.dtype, t.shape)
                                                        for k, t in tensors.items()},
                               tinker_images.image_frames(images[j], svc.config)))
    frame = TrainF(run["id"], data, call.loss_fn, call.loss_fn_config or {},
                   call.forward_only)
    f = svc.forward_backward(request["tenant"], run["id"], call.seq_id, frame,
                             output_codec.fwdbwd_encoder)
    return future_response(f, run["id"])


def _recorded_inputs(request, run: dict, j: int, d: codec.DatumIn) -> dict:
    """stable_reinforce's inputs from what the sampler recorded, found through the datum's
    provenance (every claim checked: `twinkled/core/stability.py`)."""
    for name in RECORDED_INPUTS:
        if name in d.loss_fn_inputs:
            raise UserError(f"data[{j}].loss_fn_inputs.{name}: filled in by the server from the "
                            "sampled sequences the datum's provenance names; do not send it")
    targets = d.loss_fn_inputs.get("target_tokens")
    if targets is None:
        raise UserError(f"data[{j}].loss_fn_inputs.target_tokens: required")
    logprobs, mask = checked(service(request).stability.resolve, request["tenant"],
                             run["session_id"], f"data[{j}]", d.tokens, targets.values,
                             d.model_input_spans, d.loss_fn_input_spans)
    n = len(mask)
    return {"sampler_logprobs": codec.TensorIn("float32", [n], logprobs),
            "sampled_mask": codec.TensorIn("float32", [n], mask)}


async def optim_step(request):
    body = await seq_body(request, OptimStep)
    run = await loaded_run(request, body.model_id)
    with takes_seq_id(request, run["id"], body.seq_id):
        params = _optim_params(body)
        checked(check_optim_params, _run_optimizer(run), params)
    f = service(request).optim_step(
        request["tenant"], run["id"], body.seq_id, OptimF(run["id"], params),
        lambda r: json_payload({"type": "optim_step", "metrics": _optim_metrics(r)}))
    return future_response(f, run["id"])


def _optim_params(body: OptimStep) -> AdamParams | DimuonParams:
    """`adam_params` (AdamW) or `optimizer_params` (another family: Dimuon), as the SDK
    sends one or the other."""
    if (body.adam_params is None) == (body.optimizer_params is None):
        raise UserError("adam_params or optimizer_params: exactly one is required")
    if (ap := body.adam_params) is not None:
        return AdamParams(ap.learning_rate, ap.beta1, ap.beta2, ap.eps, ap.weight_decay,
                          ap.grad_clip_norm)
    dp = body.optimizer_params
    if dp.type != "dimuon":
        raise UserError(f"optimizer_params.type: unknown optimizer {dp.type!r}; supported: "
                        "dimuon (or adam_params for AdamW)")
    if dp.damping is not None:
        # A newer SDK's row and column preconditioner, whose rule Tinker does not publish:
        # refused rather than ignored, so a run never trains on different math unawares.
        raise UserError("optimizer_params.damping: not supported by this server's Dimuon "
                        "(no row/column preconditioner); leave it unset")
    return DimuonParams(dp.learning_rate, dp.grad_clip_norm, dp.beta1,
                        dp.rank_lr_correction_exponent)


def _optim_metrics(result) -> dict[str, float]:
    return {k: float(v) for k, v in result.metrics.items() if isinstance(v, (int, float))}


def _save(request, run: dict, body: SaveWeights, name: str, kind: str, optimizer: bool,
          answer: str, overwrite: bool) -> object:
    """Save the checkpoint `name` (checked by the caller: it is in the answer's path)."""
    checked(check_ttl, "ttl_seconds", body.ttl_seconds, limits(request))
    return service(request).save(
        request["tenant"], run, body.seq_id, kind, name, optimizer=optimizer,
        user_metadata=metadata(request, body.user_metadata), ttl_s=body.ttl_seconds,
        overwrite=overwrite, answer=lambda path: json_payload({"type": answer, "path": path}))


async def save_weights(request):
    body = await seq_body(request, SaveWeights)
    run = await loaded_run(request, body.model_id)
    with takes_seq_id(request, run["id"], body.seq_id):
        if body.path is None:
            raise UserError("path: required (the checkpoint's name)")
        checked(check_name, "path", body.path, limits(request))
        f = _save(request, run, body, body.path, "weights", True, "save_weights",
                  body.overwrite)
    return future_response(f, run["id"])


async def save_weights_for_sampler(request):
    body = await seq_body(request, SaveWeights)
    run = await loaded_run(request, body.model_id)
    with takes_seq_id(request, run["id"], body.seq_id):
        if body.path:
            checked(check_name, "path", body.path, limits(request))
            f = _save(request, run, body, body.path, "sampler_weights", False,
                      "save_weights_for_sampler", True)
            return future_response(f, run["id"])
        # Ephemeral: save a snapshot and hand back a sampling session on it.
        checked(check_ttl, "ttl_seconds", body.ttl_seconds, limits(request))
        f = service(request).save_for_sampler(
            request["tenant"], run, body.seq_id, body.sampling_session_seq_id,
            user_metadata=metadata(request, body.user_metadata), ttl_s=body.ttl_seconds,
            answer=lambda sampler: json_payload({"type": "save_weights_for_sampler",
                                          "sampling_session_id": sampler}))
    return future_response(f, run["id"])


async def save_weights_external(request):
    """The adapter as PEFT files (`adapter_config.json`, `adapter_model.safetensors`; no
    optimizer state) at tinker://<run>/external_weights/<name>, downloaded through the signed
    URLs of GET .../external_weights_urls (`downloads.py`). Saved again, a name is replaced."""
    body = await seq_body(request, SaveWeights)
    run = await loaded_run(request, body.model_id)
    with takes_seq_id(request, run["id"], body.seq_id):
        if body.age_encryption_recipients:
            raise UserError("age_encryption_recipients: age-encrypted external weights are not "
                            "supported by this server; export unencrypted")
        if body.path is None:
            raise UserError("path: required (the export's name)")
        checked(check_name, "path", body.path, limits(request))
        f = _save(request, run, body, body.path, "external_weights", False,
                  "save_weights_external", True)
    return future_response(f, run["id"])


async def load_weights(request):
    body = await seq_body(request, LoadWeights)
    store, svc, tenant = request.app["store"], service(request), request["tenant"]
    if body.model_id is not None:  # legacy: load into an existing model, in its seq order
        run = await loaded_run(request, body.model_id)
        with takes_seq_id(request, run["id"], body.seq_id):
            if body.seq_id is None:
                raise UserError("seq_id: required with model_id")
            ckpt = own_checkpoint(request, body.path)
            saved = _run_optimizer(store.runs.get(ckpt["run_id"], include_deleted=True))
            if body.optimizer and saved != _run_optimizer(run):
                raise UserError(f"path: the checkpoint holds {saved!r} optimizer state; this "
                                f"model was created with {_run_optimizer(run)!r}")
        f = svc.load(tenant, run, body.seq_id, ckpt, body.optimizer, _loaded(ckpt))
        return future_response(f, run["id"])
    # create-via-load: the model is "<session>:train:<model_seq_id>", seq 0
    if body.session_id is None or body.model_seq_id is None:
        raise UserError("session_id and model_seq_id are required (or model_id)")
    s = own_session(request, body.session_id)
    ckpt = own_checkpoint(request, body.path)
    check_base_model(request, body.base_model)
    family = _loaded_optimizer(body, store.runs.get(ckpt["run_id"], include_deleted=True))
    model_id, f = svc.create_from_checkpoint(
        tenant, s["id"], body.model_seq_id, ckpt, body.optimizer, family,
        metadata(request, body.user_metadata), _loaded(ckpt))
    return future_response(f, model_id)


def _loaded(ckpt: dict):
    return lambda model: json_payload({"type": "load_weights", "path": ckpt["tinker_path"],
                                       "model_id": model})


def _loaded_optimizer(body: LoadWeights, src: dict) -> str:
    """A model created from a checkpoint: with its optimizer state, the checkpoint's family
    (Tinker: "Dimuon identity retained by full-state resume"); weights only, the one asked
    for (`optimizer_config`, AdamW by default)."""
    if not body.optimizer:
        return _optimizer(body.optimizer_config)
    saved = _run_optimizer(src)
    if body.optimizer_config is not None and _optimizer(body.optimizer_config) != saved:
        raise UserError(f"optimizer_config.type: the checkpoint's optimizer state is "
                        f"{saved!r}")
    return saved


async def weights_info(request):
    body = await body_of(request, CheckpointRef)
    c = own_checkpoint(request, body.tinker_path, ALL_KINDS)
    # A deleted run (`ctl runs delete` keeps its checkpoints) still describes them.
    run = request.app["store"].runs.get(c["run_id"], include_deleted=True)
    lc = run["lora_config"]
    return web.json_response({"base_model": run["base_model"], "is_lora": True,
                              "lora_rank": run["lora_rank"], "train_unembed": lc["train_unembed"],
                              "train_mlp": lc["train_mlp"], "train_attn": lc["train_attn"],
                              "optimizer_config": _optimizer_config(run)})
