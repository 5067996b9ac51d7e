"""The Tinker API's JSON request bodies as typed messages (msgspec), decoded once at the door.

A body that does not fit its message is a 400 naming the field (`$.lora_config.seed`), never
a 500 from a `.get()` on the wrong type. Bounds that do not depend on the model or the
daemon's settings live here (ints in int64, seq ids in a sane range); those that do are
`twinkled.protocol.checks`. Unknown fields are ignored: newer clients may send more.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from twinkled.protocol.errors import UserError

Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
SeqId = Annotated[int, Meta(ge=0, le=2**53)]
Count = Annotated[int, Meta(ge=0, le=2**31 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Ttl = Annotated[int, Meta(ge=1, le=2**40)]
Finite = Annotated[float, Meta(ge=-1e30, le=1e30)]  # rules out inf and 1e400
Metadata = dict[str, Any]


class Body(Struct, kw_only=True):
    type: str | None = None  # the SDK names the request; never needed


class CreateSession(Body):
    user_metadata: Metadata | None = None
    tags: list[str] | None = None
    sdk_version: Annotated[str, Meta(max_length=64)] | None = None  # stored: "0.38.0"
    display_name: Annotated[str, Meta(max_length=256)] | None = None  # shown and searched


class FinishReason(Struct, kw_only=True):
    type: str = "success"  # success | errored | interrupted


class FinishSession(Struct, kw_only=True):
    reason: FinishReason | None = None
    detail: str | None = None


class SessionRef(Body):
    session_id: str


class LoraConfigIn(Struct, kw_only=True):
    rank: Count = 32
    seed: Seed | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


class OptimizerConfigIn(Struct, kw_only=True):
    type: str = "adamw"  # or "dimuon" (with version 1)
    version: Count | None = None


class CreateModel(Body):
    session_id: str
    model_seq_id: Count
    base_model: str | None = None
    lora_config: LoraConfigIn = msgspec.field(default_factory=LoraConfigIn)
    user_metadata: Metadata | None = None
    optimizer_config: OptimizerConfigIn | None = None


class ModelRef(Body):
    model_id: str


class AdamIn(Struct, kw_only=True):
    learning_rate: Finite = 1e-4
    beta1: Finite = 0.9
    beta2: Finite = 0.95
    eps: Finite = 1e-12
    weight_decay: Finite = 0.0
    grad_clip_norm: Finite = 0.0


class DimuonIn(Struct, kw_only=True):
    """Tinker's DimuonParams (`optimizer_params`). 0.38 clients send the first four fields;
    newer ones may send the last two (twinkled/engine/dimuon.py says what each means)."""

    type: str = "dimuon"
    learning_rate: Finite  # the SDK has no default
    grad_clip_norm: Finite = 0.0
    beta1: Finite = 0.9
    rank_lr_correction_exponent: Finite = 0.175
    damping: Finite | None = None  # named so that it is refused, not ignored


class OptimStep(Body):
    model_id: str
    seq_id: SeqId
    adam_params: AdamIn | None = None
    optimizer_params: DimuonIn | None = None


class SaveWeights(Body):
    model_id: str
    seq_id: SeqId
    path: str | None = None
    ttl_seconds: Ttl | None = None
    overwrite: bool = False
    user_metadata: Metadata | None = None
    sampling_session_seq_id: Count | None = None
    kind: str | None = None
    age_encryption_recipients: list[str] | None = None  # save_weights_external: refused


class LoadWeights(Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: SeqId | None = None
    session_id: str | None = None
    model_seq_id: Count | None = None
    base_model: str | None = None
    user_metadata: Metadata | None = None
    optimizer_config: OptimizerConfigIn | None = None  # create-via-load, weights only


class CheckpointRef(Body):
    tinker_path: str


class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: Count | None = None
    model_path: str | None = None
    base_model: str | None = None


class ChunkIn(Struct, kw_only=True):
    type: str = "encoded_text"
    tokens: list[TokenId] = []
    # An ImageChunk's (its bytes come base64 in JSON) or an ImageAssetPointerChunk's:
    # checked and expanded at the door (tinker_shim/images.py).
    data: bytes = b""
    format: str = ""
    location: str = ""
    expected_tokens: Count | None = None


class ModelInputIn(Struct, kw_only=True):
    chunks: list[ChunkIn]


class SamplingParamsIn(Struct, kw_only=True):
    max_tokens: Count | None = None
    temperature: Annotated[float, Meta(ge=0, le=1e6)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] = -1
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    seed: Seed | None = None
    stop: str | list[str | Int64] | None = None


class TensorJsonIn(Struct):
    """TensorData in its JSON form (tinker_api.md §7.2): dense, or sparse CSR."""

    data: list[Int64]
    dtype: Literal["int64"]
    shape: list[Count] | None = None
    sparse_crow_indices: list[Count] | None = None
    sparse_col_indices: list[Count] | None = None


class Asample(Body):
    sampling_session_id: str
    prompt: ModelInputIn
    sampling_params: SamplingParamsIn = msgspec.field(default_factory=SamplingParamsIn)
    num_samples: Count = 1
    # Samples are not ordered; a cloned client (unpickled, or from_sampler_handle) counts
    # from 1e9 * a random clone id, so any int64 is a sample's seq_id.
    seq_id: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: Count = 0
    topk_sample_logprobs: Count = 0
    prompt_alt_tokens_k: Count = 0
    target_prompt_logprobs: TensorJsonIn | None = None
    prompt_logprobs_last_n: Count | None = None
    # Keep each sampled sequence for stable_reinforce (twinkled/core/stability.py).
    record_stability_info: bool | None = None


class SeqRef(Struct):
    """What a seq_id-carrying body must hold for a refusal of it to take its seq_id."""

    model_id: str | None = None
    seq_id: SeqId | None = None


class RetrieveFuture(Body):
    request_id: str


class SetTtl(Struct, kw_only=True):
    ttl_seconds: Ttl | None = None


class SearchOwner(Struct, kw_only=True):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = None


class StatusQuery(Struct, kw_only=True):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = None


class SearchCursor(Struct, kw_only=True):
    last_created_at: Annotated[datetime, Meta(tz=True)]
    last_session_id: str


class SessionSearch(Body):
    """POST /sessions/search (SDK SessionSearchRequest)."""

    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    display_name: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    owner: SearchOwner = msgspec.field(default_factory=SearchOwner)
    statuses: Annotated[list[StatusQuery], Meta(min_length=1)] | None = None
    limit: Annotated[int, Meta(ge=1, le=200)] = 50
    cursor: SearchCursor | None = None


M = TypeVar("M")
_decoders: dict[type, msgspec.json.Decoder] = {}


def decode(raw: bytes, message: type[M]) -> M:
    """Decode a JSON body into `message`; a 400 naming the field if it does not fit."""
    dec = _decoders.get(message)
    if dec is None:
        dec = _decoders[message] = msgspec.json.Decoder(message)
    try:
        return dec.decode(raw)
    except msgspec.ValidationError as e:
        raise UserError(f"invalid request body: {e}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise UserError(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise UserError("request body is nested too deeply") from None


def seq_ref(raw: bytes) -> SeqRef | None:
    """model_id and seq_id of a body that did not decode as a whole, if they are there."""
    try:
        ref = msgspec.json.decode(raw, type=SeqRef)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return None
    return ref if ref.model_id and ref.seq_id is not None else None


def encoded_size(value: Any) -> bytes:
    """`value` as compact JSON (what is stored), to measure it."""
    return msgspec.json.encode(value)
