"""``ForwardBackwardOutput``, the protobuf payload of a forward / forward_backward future on
the Tinker 0.38 wire (reference: tinker_api.md §6.3, §7.6): per-datum output tensors grouped
into ArrayRecords, and the step's metrics. The schema and the array packing are codec.py's.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

from .codec import DT_FLOAT32, DT_INT64, PROTOBUF, DType, TensorIn, message_class, pack

__all__ = ["OutTensor", "encode_forward_backward_output", "fwdbwd_encoder"]

_FwdBwdOutputPb = message_class("ForwardBackwardOutput")
_DTYPE_OUT = {"float32": (DT_FLOAT32, "f"), "int64": (DT_INT64, "q")}
_METRIC_REDUCTIONS = {"mean", "sum", "min", "max", "slack", "hash2", "unique"}


# Per-datum output values: numbers, or an already-packed little-endian buffer of the dtype.
Values = Sequence[float] | Sequence[int] | bytes | bytearray | memoryview
# (values, dtype) is 1-D; a TensorIn's shape[1:] becomes the trailing shape (e.g. [N, K]).
OutTensor = tuple[Values, DType] | TensorIn


def encode_forward_backward_output(
    outputs: Sequence[Mapping[str, OutTensor]],
    metrics: Mapping[str, float],
    loss_fn_output_type: str = "ArrayRecord",
) -> bytes:
    """``ForwardBackwardOutput`` for a forward / forward_backward future.

    ``outputs`` has one mapping per request datum, in request order, e.g.
    ``{"logprobs": (lp, "float32"), "elementwise_loss": (loss, "float32")}``; every datum must
    carry the same field names. Metric keys must be ``name:reduction`` (client grammar, §7.6).
    """
    msg = _FwdBwdOutputPb(loss_fn_output_type=loss_fn_output_type)
    for key, value in metrics.items():
        name, colon, reduction = key.partition(":")
        if not name or not colon or reduction not in _METRIC_REDUCTIONS:
            # The client crashes on a key without exactly one ':' and drops unknown reductions.
            raise ValueError(f"metric key {key!r} is not 'name:<{'|'.join(_METRIC_REDUCTIONS)}>'")
        msg.metrics[key] = float(value)
    names = sorted(outputs[0]) if outputs else []
    # The client slices each field per datum by byte offsets; dtype and trailing shape are per
    # ArrayRecord, so a change in either between consecutive datums starts a new record.
    runs: list[tuple[tuple[Any, ...], list[dict[str, tuple[int, tuple[int, ...], bytes]]]]] = []
    for i, out in enumerate(outputs):
        if sorted(out) != names:
            raise ValueError(f"outputs[{i}] has fields {sorted(out)}, outputs[0] has {names}")
        packed = {name: _pack_output(out[name], f"outputs[{i}][{name!r}]") for name in names}
        signature = tuple((name, dt, trailing) for name, (dt, trailing, _) in packed.items())
        if not runs or runs[-1][0] != signature:
            runs.append((signature, []))
        runs[-1][1].append(packed)
    for signature, run in runs:
        # num_datums is what the client counts, even for records without fields. type_tag is
        # left empty: the client ignores it.
        record = msg.loss_fn_outputs.add(num_datums=len(run))
        for name, dt, trailing in signature:
            parts = [packed[name][2] for packed in run]
            field = record.fields[name]
            field.data = b"".join(parts)
            field.offsets = pack(array("q", accumulate(map(len, parts), initial=0)))
            field.dtype = dt
            field.trailing_shape.extend(trailing)
    return msg.SerializeToString()


def _pack_output(tensor: OutTensor, where: str) -> tuple[int, tuple[int, ...], bytes]:
    if isinstance(tensor, TensorIn):
        values, dtype, trailing = tensor.values, tensor.dtype, tuple(tensor.shape[1:])
    else:
        (values, dtype), trailing = tensor, ()
    if dtype not in _DTYPE_OUT:
        raise ValueError(f"{where}: dtype must be float32 or int64, got {dtype!r}")
    dt, typecode = _DTYPE_OUT[dtype]
    if isinstance(values, bytes | bytearray | memoryview):
        data = bytes(values)
        itemsize = array(typecode).itemsize
        if len(data) % itemsize:
            raise ValueError(f"{where}: {len(data)} bytes is not a multiple of {itemsize}")
        count = len(data) // itemsize
    else:
        data, count = pack(array(typecode, values)), len(values)
    if trailing and count % math.prod(trailing):
        raise ValueError(f"{where}: {count} values do not fit trailing shape {list(trailing)}")
    return dt, trailing, data


# ---------------------------------------------------------------- future encoders (routes.py)


def fwdbwd_encoder(result: Any) -> tuple[bytes, str]:
    """Encode a twinkled ``ForwardBackwardResult`` (``.outputs``, ``.metrics``) for a future."""
    outputs = [{name: _as_out_tensor(v) for name, v in out.items()} for out in result.outputs]
    return encode_forward_backward_output(outputs, result.metrics), PROTOBUF


def _as_out_tensor(value: Any) -> OutTensor:
    if isinstance(getattr(value, "data", None), bytes):  # a worker's raw buffer (frames.Buf)
        if len(value.shape) <= 1:
            return (value.data, value.dtype)
        return TensorIn(value.dtype, list(value.shape), value.values())
    if not hasattr(value, "detach"):  # a plain list of floats
        return (value, "float32")
    # A torch.Tensor, duck-typed so that this module never imports torch.
    t = value.detach().cpu().contiguous()
    if t.is_floating_point():
        t, dtype = t.float(), "float32"  # bf16/fp16 widen; the client only knows f32/i64
    else:
        t, dtype = t.long(), "int64"
    if t.dim() <= 1:
        return (t.numpy().tobytes(), dtype)  # native order is little-endian wherever torch runs
    return TensorIn(dtype, list(t.shape), t.reshape(-1).tolist())
