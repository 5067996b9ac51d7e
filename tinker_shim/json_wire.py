"""The JSON wire of tinker SDKs before 0.25 (tinker_api.md §1, §7.2), beside the protobuf one.

Up to 0.24 the SDK posts ``forward_backward`` as JSON (``Content-Type: application/json``;
protobuf only when a server flag asks for it) and ``forward`` to its own ``/api/v1/forward``.
Up to 0.17 it cannot read a protobuf result either: its ``retrieve_future`` does not send
``Accept: application/x-protobuf`` and parses the answer as JSON.

In:  those JSON bodies, decoded into the same ``FwdBwdCall`` as the protobuf wire (codec.py),
     through typed messages (msgspec) and the same bounds, so a bad one is refused with the
     same kind of 400 naming the field.
Out: a ``forward_backward`` / ``sample`` future's protobuf payload as the JSON result those
     clients read (``ForwardBackwardOutput``, ``SampleResponse``), for a poll that does not
     accept protobuf. The payload is stored once, as protobuf; this is computed per poll.
"""

from __future__ import annotations

import json
import math
import sys
from array import array
from typing import Any, Literal

from msgspec import Struct

from twinkled.protocol.errors import UserError

from . import codec
from .codec import CodecError, DatumIn, FwdBwdCall, TensorIn
from .messages import Body, Count, Finite, Int64, ModelInputIn, SeqId, decode, seq_ref
from .sample_codec import EMPTY_LOGPROB

__all__ = ["decode_json_forward", "json_result", "wants_json"]

JSON = "application/json"


class TensorDataJson(Struct):
    """TensorData's JSON form: dense (shape optional, 1-D if absent) or sparse CSR."""

    data: list[int | float]  # bounds checked per dtype below, naming the input
    dtype: Literal["int64", "float32"]
    shape: list[Count] | None = None
    sparse_crow_indices: list[Int64] | None = None
    sparse_col_indices: list[Int64] | None = None


class DatumJson(Struct):
    model_input: ModelInputIn
    loss_fn_inputs: dict[str, TensorDataJson] = {}


class FwdBwdInputJson(Struct):
    data: list[DatumJson]
    loss_fn: str
    loss_fn_config: dict[str, Finite] | None = None


class ForwardBackwardJson(Body):
    """POST /api/v1/forward_backward, JSON (SDK <= 0.24)."""

    forward_backward_input: FwdBwdInputJson
    model_id: str
    seq_id: SeqId | None = None  # optional in those SDKs' types; always sent


class ForwardJson(Body):
    """POST /api/v1/forward (SDK <= 0.24; 0.25 sends forward_backward with forward_only)."""

    forward_input: FwdBwdInputJson
    model_id: str
    seq_id: SeqId | None = None


def decode_json_forward(raw: bytes, forward_only: bool) -> FwdBwdCall:
    """A JSON ``forward_backward`` (or, `forward_only`, ``forward``) body as the call the
    protobuf wire gives; ``CodecError`` (with the envelope's ids when it had them) if not."""
    try:
        msg = decode(raw, ForwardJson if forward_only else ForwardBackwardJson)
    except UserError as e:  # UserError: a 400 naming the field; the seq_id is still taken
        ref = seq_ref(raw)
        raise CodecError(str(e), ref and ref.model_id, ref and ref.seq_id) from None
    body = msg.forward_input if forward_only else msg.forward_backward_input
    seq_id = msg.seq_id or 0  # 0: unset, as on the protobuf wire
    try:
        if not body.data:
            raise CodecError("data: a forward_backward request needs at least one datum")
        if body.loss_fn == "custom":
            raise CodecError(codec.CUSTOM_LOSS_REFUSAL)
        return FwdBwdCall(model_id=msg.model_id, seq_id=seq_id, forward_only=forward_only,
                          loss_fn=body.loss_fn, loss_fn_config=body.loss_fn_config or None,
                          data=[_datum(i, d) for i, d in enumerate(body.data)])
    except CodecError as e:
        raise CodecError(str(e), msg.model_id or None, seq_id) from None


def _datum(i: int, d: DatumJson) -> DatumIn:
    tokens: list[int] = []
    for chunk in d.model_input.chunks:
        if chunk.type != "encoded_text":
            why = codec.CHUNK_REFUSALS.get(chunk.type, f"chunks of type {chunk.type!r} are "
                                           "not supported")
            raise CodecError(f"data[{i}].model_input: {why}")
        tokens.extend(chunk.tokens)
    inputs = {name: _tensor(t, f"data[{i}].loss_fn_inputs[{name!r}]")
              for name, t in d.loss_fn_inputs.items()}
    return DatumIn(tokens=tokens, loss_fn_inputs=inputs)


def _tensor(t: TensorDataJson, where: str) -> TensorIn:
    if t.dtype == "int64":
        if any(isinstance(v, float) for v in t.data):
            raise CodecError(f"{where}: an int64 tensor holds non-integer values")
        if any(not _INT64_MIN <= v <= _INT64_MAX for v in t.data):
            raise CodecError(f"{where}: a value is out of the int64 range")
        values: list = t.data
    else:
        values = [float(v) for v in t.data]
        if any(not abs(v) <= _FLOAT32_MAX for v in values):  # what protobuf could carry
            raise CodecError(f"{where}: a value is out of the float32 range")
    shape = t.shape
    if shape is not None and math.prod(shape) > codec.MAX_TENSOR_ELEMENTS:
        raise CodecError(f"{where}: shape {shape} has more than {codec.MAX_TENSOR_ELEMENTS} "
                         "elements")
    if t.sparse_crow_indices is not None or t.sparse_col_indices is not None:
        if shape is None or t.sparse_crow_indices is None or t.sparse_col_indices is None:
            raise CodecError(f"{where}: a sparse tensor needs shape, sparse_crow_indices and "
                             "sparse_col_indices")
        values = codec.expand_csr(values, t.sparse_crow_indices, t.sparse_col_indices, shape,
                                  where)
    elif shape is None:  # the SDK infers 1-D
        shape = [len(values)]
    elif math.prod(shape) != len(values):
        raise CodecError(f"{where}: shape {shape} does not match {len(values)} values")
    return TensorIn(dtype=t.dtype, shape=list(shape), values=values)


# ---------------------------------------------------------------- results


def wants_json(accept: str | None) -> bool:
    """Does a ``retrieve_future`` poll need a JSON result? Only one that does not name
    protobuf (SDK <= 0.17, which asks for `application/json`); 0.18-0.24 accept both, 0.25
    on protobuf only. A poll that names no type, or any (`*/*`, a raw HTTP client's default),
    gets protobuf, what today's SDK reads."""
    accept = accept or ""
    return "application/json" in accept and "application/x-protobuf" not in accept


def json_result(kind: str, payload: bytes) -> bytes | None:
    """The JSON form of a future's protobuf payload, for the future kinds that have one."""
    convert = _RESULTS.get(kind)
    return None if convert is None else json.dumps(convert(payload)).encode()


def _numbers(buf: bytes, typecode: str) -> array:
    arr = array(typecode, buf)  # the wire is little-endian
    if sys.byteorder == "big":
        arr.byteswap()
    return arr


def _floats(buf: bytes) -> list[float]:
    return _numbers(buf, "f").tolist()


def _forward_backward_output(payload: bytes) -> dict:
    msg = codec.message_class("ForwardBackwardOutput").FromString(payload)
    outputs: list[dict[str, Any]] = []
    for record in msg.loss_fn_outputs:  # datums of one record share dtype and trailing shape
        datums: list[dict[str, Any]] = [{} for _ in range(record.num_datums)]
        for name, field in record.fields.items():
            dtype, typecode = _DTYPES[field.dtype]
            flat = _numbers(field.data, typecode)
            offsets = _numbers(field.offsets, "q").tolist()
            trailing = list(field.trailing_shape)
            width = math.prod(trailing)
            for j, out in enumerate(datums):
                lo, hi = offsets[j] // flat.itemsize, offsets[j + 1] // flat.itemsize
                out[name] = {"data": flat[lo:hi].tolist(), "dtype": dtype,
                             "shape": [(hi - lo) // width if width else 0, *trailing]}
        outputs.extend(datums)
    return {"loss_fn_output_type": msg.loss_fn_output_type, "loss_fn_outputs": outputs,
            "metrics": dict(msg.metrics)}


def _sample_response(payload: bytes) -> dict:
    msg = codec.message_class("SampleResponse").FromString(payload)
    body: dict[str, Any] = {"type": "sample", "sequences": [
        {"stop_reason": _STOP_REASONS[s.stop_reason], "tokens": _numbers(s.tokens, "i").tolist(),
         "logprobs": _floats(s.logprobs) if s.logprobs else None} for s in msg.sequences],
        "prompt_cache_hit_tokens": msg.prompt_cache_hit_tokens}
    if msg.prompt_logprobs:  # NaN: nothing computed (position 0)
        body["prompt_logprobs"] = [None if math.isnan(v) else v
                                   for v in _floats(msg.prompt_logprobs)]
    if msg.HasField("topk_prompt_logprobs"):
        body["topk_prompt_logprobs"] = _topk_rows(msg.topk_prompt_logprobs)
    return body


def _topk_rows(topk: Any) -> list[list[tuple[int, float]] | None]:
    """[length, k] matrices as rows of (id, logprob); empty cells dropped, an empty row
    None (sample_codec.py pads them so)."""
    ids, lps, k = _numbers(topk.token_ids, "i").tolist(), _floats(topk.logprobs), topk.k
    rows: list[list[tuple[int, float]] | None] = []
    for r in range(topk.length):
        row = [(ids[c], lps[c]) for c in range(r * k, (r + 1) * k) if lps[c] != EMPTY_LOGPROB]
        rows.append(row or None)
    return rows


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_FLOAT32_MAX = 3.4028234663852886e38
_DTYPES = {1: ("float32", "f"), 2: ("int64", "q")}  # the wire enum: codec._DTYPE_OUT
_STOP_REASONS = {0: "stop", 1: "length"}
_RESULTS = {"forward_backward": _forward_backward_output, "forward": _forward_backward_output,
            "sample": _sample_response}
