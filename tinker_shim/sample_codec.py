"""The sampling side of the Tinker protobuf wire (reference: tinker_api.md §6.3).

Out: ``SampleResponse`` for an asample future: the sequences (tokens, logprobs, top-k per
sampled token) and what the request asked about its prompt (logprobs, top-k rows, target
ids' logprobs, alternative draws). In: the ``target_prompt_logprobs`` id tensor, which the
0.38 client sends as JSON, dense or sparse CSR.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from .codec import DT_FLOAT32, DT_INT64, PROTOBUF, CodecError, csr_consistent, message_class, pack

_SampleResponsePb = message_class("SampleResponse")
_STOP_REASONS = {"stop": 0, "length": 1}
# An empty cell of a top-k row (the client reads a row of these as None).
EMPTY_ID, EMPTY_LOGPROB = 0, -99999.0

TopK = tuple[Sequence[Sequence[int]], Sequence[Sequence[float]]]


class SampledOut(msgspec.Struct, frozen=True):
    tokens: list[int]
    logprobs: list[float] | None
    stop_reason: Literal["stop", "length"]
    topk: TopK | None = None  # (ids, logprobs) per sampled token


class Layout(msgspec.Struct, frozen=True):
    """A sparse CSR request tensor's cells: the answer to it is sparse in the same cells."""

    crow: list[int]
    col: list[int]


def encode_sample_response(
    sequences: Sequence[SampledOut | Mapping[str, Any]],
    prompt_logprobs: Sequence[float | None] | None = None,
    *,
    prompt_cache_hit_tokens: int = 0,
    topk_prompt: TopK | None = None,
    target_prompt: Sequence[Sequence[float]] | None = None,
    target_layout: Layout | None = None,
    alt_tokens: TopK | None = None,
) -> bytes:
    """``SampleResponse`` for an asample future.

    ``sample_sequence_ids`` is NOT part of this message: it goes in the JSON answer to the
    ``asample`` POST, one id per sequence, in this order. ``prompt_logprobs`` has one entry per
    prompt token; ``None`` (nothing computed, e.g. position 0) is sent as NaN, which the
    client turns back into ``None``.
    """
    msg = _SampleResponsePb(prompt_cache_hit_tokens=prompt_cache_hit_tokens)
    for i, seq in enumerate(sequences):
        if isinstance(seq, Mapping):
            seq = SampledOut(**seq)
        if seq.stop_reason not in _STOP_REASONS:
            raise ValueError(f"sequences[{i}]: stop_reason must be 'stop' or 'length'")
        out = msg.sequences.add(
            stop_reason=_STOP_REASONS[seq.stop_reason], tokens=pack(array("i", seq.tokens))
        )
        if seq.logprobs is not None:
            if len(seq.logprobs) != len(seq.tokens):
                raise ValueError(f"sequences[{i}]: {len(seq.logprobs)} logprobs for "
                                 f"{len(seq.tokens)} tokens")
            out.logprobs = pack(array("f", seq.logprobs))
        if seq.topk is not None:
            _fill_topk(out.topk_sampled_logprobs, seq.topk)
    if prompt_logprobs is not None:
        lps = [math.nan if lp is None else lp for lp in prompt_logprobs]
        msg.prompt_logprobs = pack(array("f", lps))
    if topk_prompt is not None:
        _fill_topk(msg.topk_prompt_logprobs, topk_prompt)
    if target_prompt is not None:
        _fill_target(msg.target_prompt_logprobs, target_prompt, target_layout)
    if alt_tokens is not None:
        ids, lps = alt_tokens
        _fill_dense(msg.prompt_alt_tokens.tokens, ids, "q", DT_INT64)
        _fill_dense(msg.prompt_alt_tokens.logprobs, lps, "f", DT_FLOAT32)
    return msg.SerializeToString()


def sample_encoder(result: Any, target_layout: Layout | None = None) -> tuple[bytes, str]:
    """Encode a twinkled ``SampleResult`` for a future (``target_layout``: the request's)."""
    seqs = [SampledOut(list(s.tokens), s.logprobs, s.stop_reason, s.topk)
            for s in result.sequences]
    return encode_sample_response(
        seqs, result.prompt_logprobs, topk_prompt=result.topk_prompt,
        target_prompt=result.target_prompt, target_layout=target_layout,
        alt_tokens=result.alt_tokens, prompt_cache_hit_tokens=result.cached_tokens), PROTOBUF


def _fill_topk(msg: Any, topk: TopK) -> None:
    """Two dense row-major [length, k] matrices; rows (and their tails) padded empty."""
    ids, lps = topk
    k = max((len(row) for row in ids), default=0)
    flat_ids, flat_lps = array("i"), array("f")
    for row_ids, row_lps in zip(ids, lps, strict=True):
        pad = k - len(row_ids)
        flat_ids.extend(list(row_ids) + [EMPTY_ID] * pad)
        flat_lps.extend(list(row_lps) + [EMPTY_LOGPROB] * pad)
    msg.token_ids, msg.logprobs = pack(flat_ids), pack(flat_lps)
    msg.k, msg.length = k, len(ids)


def _fill_dense(msg: Any, rows: Sequence[Sequence[float]], typecode: str, dtype: int) -> None:
    msg.dtype = dtype
    msg.shape.extend([len(rows), len(rows[0]) if rows else 0])
    msg.dense = pack(array(typecode, [v for row in rows for v in row]))


def _fill_target(msg: Any, rows: Sequence[Sequence[float]], layout: Layout | None) -> None:
    """The same shape as the request's ids, and sparse in the same cells if it was."""
    if layout is None:
        _fill_dense(msg, rows, "f", DT_FLOAT32)
        return
    msg.dtype = DT_FLOAT32
    msg.shape.extend([len(rows), len(rows[0]) if rows else 0])
    values = [rows[r][layout.col[j]] for r in range(len(rows))
              for j in range(layout.crow[r], layout.crow[r + 1])]
    msg.sparse_csr.values = pack(array("f", values))
    msg.sparse_csr.crow_indices = pack(array("q", layout.crow))
    msg.sparse_csr.col_indices = pack(array("q", layout.col))


def target_ids(data: list, shape: list[int] | None, crow: list[int] | None,
               col: list[int] | None, max_cells: int) -> tuple[list[list[int]], Layout | None]:
    """The JSON ``target_prompt_logprobs`` tensor as dense [rows, K] ids (-1: nothing), and
    its sparse layout if it came sparse. Checks the layout; the ids are checked against the
    prompt and the vocabulary in engine/checks.py."""
    where = "target_prompt_logprobs"
    if shape is None or len(shape) != 2:
        raise CodecError(f"{where}: must be 2-D [len(prompt) - 1, K], got shape {shape}")
    rows, cols = shape
    if rows * cols > max_cells:
        raise CodecError(f"{where}: {rows} x {cols} cells; at most {max_cells}")
    if any(not isinstance(v, int) or isinstance(v, bool) for v in data):
        raise CodecError(f"{where}: must hold int64 token ids")
    if crow is None and col is None:
        if len(data) != rows * cols:
            raise CodecError(f"{where}: shape {shape} does not match {len(data)} values")
        return [data[r * cols:(r + 1) * cols] for r in range(rows)], None
    if crow is None or col is None or not csr_consistent(crow, col, len(data), rows, cols):
        raise CodecError(f"{where}: inconsistent sparse CSR indices for shape {shape}")
    dense = [[-1] * cols for _ in range(rows)]  # unlisted cells ask for nothing
    for r in range(rows):
        for j in range(crow[r], crow[r + 1]):
            dense[r][col[j]] = data[j]
    return dense, Layout(list(crow), list(col))
