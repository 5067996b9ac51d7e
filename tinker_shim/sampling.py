"""Tinker sampling routes: sampling sessions, samplers, asample."""

from __future__ import annotations

import asyncio
import secrets

from aiohttp import web

from twinkled.protocol.checks import check_knobs, check_prompt_scores, check_sample
from twinkled.protocol.errors import Conflict, NotFound, UserError
from twinkled.protocol.frames import SampleF, SamplingF, buf

from . import images as tinker_images
from .codec import CodecError
from .common import (
    body_of,
    check_base_model,
    checked,
    future_response,
    limits,
    own_checkpoint,
    own_session,
    sampler_adapter,
    service,
)
from .messages import Asample, CreateSamplingSession, ModelInputIn, TensorJsonIn
from .sample_codec import sample_encoder, target_ids


async def create_sampling_session(request):
    body = await body_of(request, CreateSamplingSession)
    s = own_session(request, body.session_id)
    store = request.app["store"]
    path = body.model_path
    if path:
        own_checkpoint(request, path)
    else:
        check_base_model(request, body.base_model)
    seq = body.sampling_session_seq_id
    try:
        sampler_id = store.samplers.create(s["id"], request["tenant"],
                                           service(request).config.served_name, path, seq)
    except Conflict:
        # A client that lost the answer sends the same request again: the sampler it made.
        sampler_id = store.samplers.id_of(s["id"], seq)
        if (store.samplers.get(sampler_id) or {}).get("model_path") != path:
            raise UserError("that sampling_session_seq_id is already used") from None
    return web.json_response({"type": "create_sampling_session", "sampling_session_id": sampler_id})


def _own_sampler(request, sampler_id: str) -> dict:
    s = request.app["store"].samplers.get(sampler_id)
    if s is None or s["tenant"] != request["tenant"]:
        raise NotFound(f"no sampler {sampler_id!r}")
    return s


async def get_sampler(request):
    s = _own_sampler(request, request.match_info["sampler_id"])
    # The served name the sampler was made under, never the server's model directory.
    # SamplingClient.get_tokenizer loads its tokenizer by this name, so a daemon whose
    # clients need that serves under the hub id (--model-name; docs/reference.md).
    body = {"sampler_id": s["id"], "base_model": s["base_model"]}
    if s.get("model_path"):
        body["model_path"] = s["model_path"]
    return web.json_response(body)


async def asample(request):
    body = await body_of(request, Asample)
    sampler = _own_sampler(request, body.sampling_session_id)
    svc = service(request)
    tokens, images = _prompt_tokens(body.prompt), []
    if tokens is None:  # images: decoded and checked off the event loop
        tokens, images = await asyncio.to_thread(
            tinker_images.expand_prompt, body.prompt, svc.config, sampler["base_model"])
    lim = limits(request)
    target, layout = _target_ids(body.target_prompt_logprobs, lim.max_prompt_cells)
    checked(check_prompt_scores, tokens, body.prompt_logprobs, body.prompt_logprobs_last_n,
            body.topk_prompt_logprobs, body.topk_sample_logprobs, body.prompt_alt_tokens_k,
            target, lim)
    sp = body.sampling_params
    stop = [sp.stop] if isinstance(sp.stop, str) else sp.stop
    # max_tokens unset: Tinker's default of 16 (never "up to the whole context": a client
    # that forgets it must not hold a step for tens of thousands of tokens).
    max_tokens = 16 if sp.max_tokens is None else sp.max_tokens
    checked(check_knobs, sp.temperature, sp.top_p, sp.top_k)
    checked(check_sample, tokens, max_tokens, body.num_samples, stop, lim)
    params = SamplingF(max_tokens, sp.temperature, sp.top_k, sp.top_p, sp.seed, stop)
    n = body.num_samples
    path = sampler.get("model_path")
    adapter = load_from = None
    if path:
        adapter, load_from = sampler_adapter(path, own_checkpoint(request, path))
    frame = SampleF(adapter, buf(tokens, "int64"), params, n, body.prompt_logprobs, load_from,
                    prompt_last_n=body.prompt_logprobs_last_n,
                    topk_prompt=body.topk_prompt_logprobs,
                    topk_sample=body.topk_sample_logprobs,
                    target_prompt=None if target is None else buf(
                        [t for row in target for t in row], "int64",
                        [len(target), len(target[0])]),
                    alt_tokens_k=body.prompt_alt_tokens_k,
                    images=tinker_images.image_frames(images, svc.config))
    # One id per sequence, never reused: a retried submission (same seq_id) is a new one,
    # and stable_reinforce's records are found by these ids.
    tag = secrets.token_hex(6)
    ids = [f"{sampler['id']}:{body.seq_id or 0}:{tag}:{i}" for i in range(n)]
    f = svc.sample(
        request["tenant"], sampler, frame,
        lambda result: sample_encoder(result, target_layout=layout),
        record=(ids, tokens) if body.record_stability_info else None)
    return future_response(f, sample_sequence_ids=ids)


def _target_ids(t: TensorJsonIn | None, max_cells: int):
    if t is None:
        return None, None
    try:
        return target_ids(t.data, t.shape, t.sparse_crow_indices, t.sparse_col_indices,
                          max_cells)
    except CodecError as e:
        raise UserError(str(e)) from None


def _prompt_tokens(prompt: ModelInputIn) -> list[int] | None:
    """ModelInput -> token ids; None if it holds images (tinker_images.expand_prompt)."""
    tokens: list[int] = []
    for i, chunk in enumerate(prompt.chunks):
        if chunk.type in ("image", "image_asset_pointer"):
            return None
        if chunk.type != "encoded_text":
            raise UserError(f"prompt.chunks[{i}]: chunks of type {chunk.type!r} are not "
                            "supported (text-only models)")
        tokens.extend(chunk.tokens)
    return tokens
