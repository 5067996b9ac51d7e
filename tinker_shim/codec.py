"""Protobuf codec for the Tinker 0.38 wire (reference: tinker_api.md §6).

In:  the body of ``POST /api/v1/forward_backward`` (``ForwardBackwardRequest``, maybe zstd).
Out: the ``retrieve_future`` payloads the client only accepts as protobuf are encoded by
     output_codec.py (``ForwardBackwardOutput``) and sample_codec.py (``SampleResponse``),
     with this module's schema and packing.

Arrays on this wire are raw little-endian buffers; ``array`` does the packing so that neither
numpy nor torch is needed here. The schema is the client's own generated descriptor, read from
the installed ``tinker`` wheel *without importing the ``tinker`` package* (its ``__init__`` pulls
in the whole client, and torch when installed) and loaded into a private descriptor pool, so it
cannot clash with a ``tinker`` client imported into the same process (as in the tests).
"""

from __future__ import annotations

import ast
import importlib.util
import math
import sys
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import zstandard
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from .provenance import SpanError, SpanIn, decode_spans

__all__ = [
    "CodecError",
    "DatumIn",
    "SpanIn",
    "FwdBwdCall",
    "TensorIn",
    "decode_forward_backward",
]

DType = Literal["float32", "int64"]
# A decompressed body larger than this is refused (zstd bomb guard; the daemon passes its
# max_body_bytes). The client caps a chunk at ~5 MB before compression.
MAX_DECOMPRESSED_BYTES = 64 << 20


# Elements one loss input may declare (a sparse tensor's shape is expanded): bounds what a
# small body can make us allocate. 2**22 is far beyond any model's context.
MAX_TENSOR_ELEMENTS = 1 << 22


class CodecError(ValueError):
    """The request body is malformed or uses a feature this server does not support (a 400).

    `model_id`/`seq_id` are set when the envelope was read, so the refusal can take its
    seq_id (the client counts on past it)."""

    def __init__(self, message: str, model_id: str | None = None, seq_id: int | None = None):
        super().__init__(message)
        self.model_id, self.seq_id = model_id, seq_id


class TensorIn(msgspec.Struct, frozen=True):
    dtype: DType
    shape: list[int]
    values: list[int | float]  # dense, row-major, len == prod(shape)


class ImageIn(msgspec.Struct, frozen=True):
    """An ImageChunk as sent: decoded and expanded into placeholder tokens at the door
    (tinker_shim/images.py), never here."""
    at: int  # the index in `tokens` its placeholders go at
    data: bytes
    format: str
    expected_tokens: int | None = None


class DatumIn(msgspec.Struct, frozen=True):
    tokens: list[int]
    loss_fn_inputs: dict[str, TensorIn]
    # Provenance, both or neither (the SDK asserts the pair): None when not sent.
    model_input_spans: list[SpanIn] | None = None
    loss_fn_input_spans: list[SpanIn] | None = None
    images: list[ImageIn] = []


class FwdBwdCall(msgspec.Struct, frozen=True):
    model_id: str
    seq_id: int  # 0 means "unset" on the wire; the SDK always sends >= 1
    forward_only: bool
    loss_fn: str
    loss_fn_config: dict[str, float] | None
    data: list[DatumIn]


# ---------------------------------------------------------------- schema


def _load_pool() -> descriptor_pool.DescriptorPool:
    spec = importlib.util.find_spec("tinker")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("tinker==0.38.0 must be installed: its tinker_public_pb2 is the schema")
    src = Path(spec.submodule_search_locations[0], "proto", "tinker_public_pb2.py").read_text()
    # The generated module registers one serialized FileDescriptorProto; take that literal.
    blob = next(
        node.args[0].value
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "AddSerializedFile"
    )
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(blob)
    return pool


_POOL = _load_pool()


def message_class(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"tinker_public.{name}"))


_FwdBwdRequestPb = message_class("ForwardBackwardRequest")

# Wire enum numbers (fixed by the proto; see §6.1 / §6.3).
DT_FLOAT32, DT_INT64, _DT_INT32, _DT_BFLOAT16 = 1, 2, 3, 4
_DTYPE_IN = {DT_FLOAT32: ("float32", "f"), DT_INT64: ("int64", "q"), _DT_INT32: ("int64", "i")}
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZSTD_FEED = 4096  # compressed bytes per step: <= ~128 MiB of output even for a bomb
_BIG_ENDIAN = sys.byteorder == "big"


def _unpack(buf: bytes, typecode: str, where: str) -> array:
    arr = array(typecode)
    if len(buf) % arr.itemsize:
        raise CodecError(f"{where}: {len(buf)} bytes is not a multiple of {arr.itemsize}")
    arr.frombytes(buf)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr


def pack(arr: array) -> bytes:
    if _BIG_ENDIAN:
        arr = array(arr.typecode, arr)
        arr.byteswap()
    return arr.tobytes()


# ---------------------------------------------------------------- request


def decode_forward_backward(
    body: bytes | bytearray | memoryview,
    content_encoding: str | None = None,
    *,
    max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES,
) -> FwdBwdCall:
    """Parse a ``/api/v1/forward_backward`` body; raise ``CodecError`` on anything unusable."""
    raw = decompress(bytes(body), content_encoding, max_decompressed_bytes)
    try:
        msg = _FwdBwdRequestPb.FromString(raw)
    except DecodeError as exc:
        raise CodecError(f"malformed ForwardBackwardRequest protobuf: {exc}") from None
    try:
        if not msg.data:
            raise CodecError("data: a forward_backward request needs at least one datum")
        return FwdBwdCall(
            model_id=msg.model_id,
            seq_id=msg.seq_id,
            forward_only=msg.forward_only,
            loss_fn=msg.loss_fn,
            loss_fn_config=_decode_config(msg),
            data=[_decode_datum(i, d) for i, d in enumerate(msg.data)],
        )
    except CodecError as e:
        raise CodecError(str(e), msg.model_id or None, msg.seq_id) from None


def decompress(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """The body as sent before its Content-Encoding (zstd or none): either wire's bodies."""
    enc = (content_encoding or "").strip().lower()
    if enc not in ("", "identity", "zstd"):
        raise CodecError(f"unsupported Content-Encoding {content_encoding!r}; only zstd")
    # A plain proto body cannot start with the magic (0x28 = field 5 as a varint, but field 5 is
    # a map), so sniffing also covers proxies that drop the header.
    if enc != "zstd" and not body.startswith(_ZSTD_MAGIC):
        return body
    # Fed in small slices so that output is checked against the limit as it grows (a header's
    # content size is not trusted), and eof catches a truncated stream, which would otherwise
    # yield a shorter, still parseable protobuf.
    dobj, view = zstandard.ZstdDecompressor().decompressobj(), memoryview(body)
    parts: list[bytes] = []
    size = 0
    try:
        for start in range(0, len(body), _ZSTD_FEED):
            parts.append(dobj.decompress(view[start : start + _ZSTD_FEED]))
            size += len(parts[-1])
            if size > limit:
                raise CodecError(f"decompressed body exceeds {limit} bytes")
            if dobj.eof:
                break
    except zstandard.ZstdError as exc:
        raise CodecError(f"invalid zstd body: {exc}") from None
    if not dobj.eof:
        raise CodecError("truncated zstd body")
    if dobj.unused_data or start + _ZSTD_FEED < len(body):
        raise CodecError("data after the zstd frame (the SDK sends exactly one frame)")
    return b"".join(parts)


CUSTOM_LOSS_REFUSAL = (
    "loss_fn 'custom' (a server-side custom loss) is not served here: custom losses run on "
    "the client, with TrainingClient.forward_backward_custom(data, loss_fn)")


def _decode_config(msg: Any) -> dict[str, float] | None:
    # A server-side custom loss (loss_fn "custom", its loss_id a text value) would otherwise
    # be refused for its text config, which tells the client nothing about what to do.
    if msg.loss_fn == "custom":
        raise CodecError(CUSTOM_LOSS_REFUSAL)
    # The SDK writes numbers to both maps and strings only to _v2, so _v2 wins when present.
    if msg.loss_fn_config_v2:
        config: dict[str, float] = {}
        for key, value in msg.loss_fn_config_v2.items():
            kind = value.WhichOneof("value")
            if kind != "number":
                # Text values (e.g. a custom loss's loss_id) select behaviour we do not have;
                # dropping them would silently run a different loss.
                raise CodecError(f"loss_fn_config[{key!r}]: only numeric values are supported")
            config[key] = value.number
        return config
    return dict(msg.loss_fn_config) or None


CHUNK_REFUSALS = {
    # (the protobuf wire's image chunks are served: _decode_image)
    "image": "image chunks come through the protobuf wire of SDK >= 0.25 only",
    "dmel": "dmel (audio) chunks are not supported (text-only models)",
    None: "empty or unrecognised model_input chunk (a chunk type newer than SDK 0.38?)",
}


def _decode_datum(i: int, datum: Any) -> DatumIn:
    tokens = array("i")
    images = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind == "image":
            images.append(_decode_image(i, len(tokens), chunk.image))
            continue
        if kind != "encoded_text":
            raise CodecError(f"data[{i}].model_input: {CHUNK_REFUSALS.get(kind, kind)}")
        tokens.extend(_unpack(chunk.encoded_text.tokens, "i", f"data[{i}] tokens"))
    inputs = {
        name: _decode_tensor(tensor, f"data[{i}].loss_fn_inputs[{name!r}]")
        for name, tensor in datum.loss_fn_inputs.items()
    }
    # Provenance is read for every loss (the cookbook attaches it whenever it can) but only
    # stable_reinforce checks its claims against the sampler's records.
    try:
        model_spans = decode_spans(datum.model_input_spans, f"data[{i}].model_input_spans")
        loss_spans = decode_spans(datum.loss_fn_input_spans, f"data[{i}].loss_fn_input_spans")
    except SpanError as e:
        raise CodecError(str(e)) from None
    if (model_spans is None) != (loss_spans is None):
        raise CodecError(f"data[{i}]: provenance comes as a pair: send both model_input_spans "
                         "and loss_fn_input_spans, or neither")
    return DatumIn(tokens=tokens.tolist(), loss_fn_inputs=inputs,
                   model_input_spans=model_spans, loss_fn_input_spans=loss_spans,
                   images=images)


def _decode_image(i: int, at: int, image: Any) -> ImageIn:
    if image.HasField("override_dimensions"):
        raise CodecError(f"data[{i}].model_input: an image's override_dimensions is not served "
                         "(resize the image before sending it)")
    expected = image.expected_tokens if image.HasField("expected_tokens") else None
    return ImageIn(at, image.data, image.format, expected)


def _decode_tensor(tensor: Any, where: str) -> TensorIn:
    if tensor.dtype == _DT_BFLOAT16:
        raise CodecError(f"{where}: bfloat16 tensors are not supported; send float32")
    if tensor.dtype not in _DTYPE_IN:
        raise CodecError(f"{where}: unsupported tensor dtype (enum value {tensor.dtype})")
    dtype, typecode = _DTYPE_IN[tensor.dtype]  # int32 is widened to int64
    shape = list(tensor.shape)
    if any(dim < 0 for dim in shape):
        raise CodecError(f"{where}: negative dimension in shape {shape}")
    if math.prod(shape) > MAX_TENSOR_ELEMENTS:
        raise CodecError(f"{where}: shape {shape} has more than {MAX_TENSOR_ELEMENTS} elements")
    if tensor.WhichOneof("encoding") == "sparse_csr":
        csr = tensor.sparse_csr
        values = expand_csr(_unpack(csr.values, typecode, where).tolist(),
                            _unpack(csr.crow_indices, "q", where).tolist(),
                            _unpack(csr.col_indices, "q", where).tolist(), shape, where)
    else:  # dense, or nothing at all (an empty tensor)
        values = _unpack(tensor.dense, typecode, where).tolist()
        if not shape:  # TensorData(shape=None) sends no shape; the SDK infers 1-D
            shape = [len(values)]
        if math.prod(shape) != len(values):
            raise CodecError(f"{where}: shape {shape} does not match {len(values)} values")
    return TensorIn(dtype=dtype, shape=shape, values=values)


def csr_consistent(crow: Sequence[int], col: Sequence[int], nnz: int, rows: int,
                   cols: int) -> bool:
    """Do sparse CSR indices describe `nnz` cells of a [rows, cols] matrix?"""
    return (len(crow) == rows + 1 and crow[0] == 0 and crow[-1] == nnz and len(col) == nnz
            and all(a <= b for a, b in zip(crow, crow[1:], strict=False))
            and all(0 <= c < cols for c in col))


def expand_csr(vals: list, crow: list[int], col: list[int], shape: list[int],
               where: str) -> list[int | float]:
    """A sparse CSR tensor (either wire's) as dense row-major values."""
    if len(shape) != 2:
        raise CodecError(f"{where}: sparse_csr needs a 2-D shape, got {shape}")
    rows, cols = shape
    if not csr_consistent(crow, col, len(vals), rows, cols):
        raise CodecError(f"{where}: inconsistent sparse_csr indices for shape {shape}")
    # The pad value is not on the wire. The SDK's automatic conversion (a 2-D torch tensor in
    # Datum.loss_fn_inputs) uses TensorData.from_torch_sparse's default pad of 0.
    out: list[int | float] = [0] * (rows * cols)
    for r in range(rows):
        base = r * cols
        for j in range(crow[r], crow[r + 1]):
            out[base + col[j]] = vals[j]
    return out


PROTOBUF = "application/x-protobuf"  # the futures' payload type (output_codec.py)
