"""Tinker sampling routes: sampling sessions, samplers, asample."""

from __future__ import annotations

from aiohttp import web

from twinkled.service import NotFound, Op, UserError
from twinkled.store import Conflict

from . import codec
from .common import (
    check_base_model,
    field,
    future_response,
    json_body,
    own_checkpoint,
    own_session,
    service,
)


async def create_sampling_session(request):
    body = await json_body(request)
    s = own_session(request, field(body, "session_id"))
    store = request.app["store"]
    path = body.get("model_path")
    if path:
        own_checkpoint(request, path)
    else:
        check_base_model(request, body.get("base_model"))
    try:
        sampler_id = store.create_sampler(s["id"], request["tenant"],
                                          service(request).config.served_name, path,
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

    body = await json_body(request)
    sampler = _own_sampler(request, field(body, "sampling_session_id"))
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
        c = own_checkpoint(request, path)
        # Keyed by content too: a checkpoint saved again under the same name is new weights.
        adapter = f"sampler:{path}@{c['sha256'][:16]}"
        args = {"adapter_id": adapter, "load_from": c["dir"]}
    req = SampleRequest(adapter, tokens, params, n, bool(body.get("prompt_logprobs", False)))
    svc = service(request)
    f = svc.new_future(request["tenant"], "sample", codec.sample_encoder)
    tokens = len(tokens) + params.max_tokens * n
    svc.submit(Op("sample", None, None, {"request": req, **args}, f, tokens))
    seq = body.get("seq_id", 0)
    ids = [f"{sampler['id']}:{seq}:{i}" for i in range(n)]
    return future_response(f, sample_sequence_ids=ids)


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
