"""The frames the daemon and its workers exchange over ZeroMQ (msgspec, msgpack).

Torch-free on purpose: the daemon builds and reads these without importing torch. Arrays
travel as raw little-endian buffers with their dtype and shape (`Buf`), never as lists of
numbers. A step is encoded once and the same bytes go to every rank (SPMD); each rank
answers with the outcomes of the part it ran.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from twinkled.engine.types import (
    AdamParams,
    AdapterInfo,
    Datum,
    ForwardBackwardRequest,
    LoraConfig,
    OptimResult,
    SampleRequest,
    SampleResult,
)

_TYPECODES = {"int64": "q", "float32": "f"}
# An outcome's category when the op could not run because a pass it shared failed: the
# daemon restores that pass's adapters and runs its ops one at a time (worker_client.py).
RETRY = "retry"


class Buf(msgspec.Struct, array_like=True):
    dtype: str  # "int64" | "float32"
    shape: list[int]
    data: bytes

    def values(self) -> list:
        a = array(_TYPECODES[self.dtype])
        a.frombytes(self.data)
        return a.tolist()


def buf(values: Any) -> Buf:
    """A list (or array) of numbers as a Buf: int64 when every value is an int, else float32."""
    if isinstance(values, Buf):
        return values
    if isinstance(values, array):
        a = values if values.typecode in ("q", "f") else array("f", values)
    else:
        try:
            a = array("q", values)
        except (TypeError, OverflowError):  # floats (or ints too large): the engine says so
            a = array("f", values)
    return Buf("int64" if a.typecode == "q" else "float32", [len(a)], a.tobytes())


class DatumF(msgspec.Struct, array_like=True):
    tokens: Buf
    inputs: dict[str, Buf]


class FwdBwdF(msgspec.Struct):
    """A forward/backward request (or a piece of one), checked at the daemon's door."""

    adapter_id: str | None
    data: list[DatumF]
    loss_fn: str
    loss_config: dict[str, float]
    forward_only: bool


class SamplingF(msgspec.Struct):
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: list[str | int] | None


class SampleF(msgspec.Struct):
    adapter_id: str | None
    prompt: Buf
    params: SamplingF
    num_samples: int
    prompt_logprobs: bool


class OpF(msgspec.Struct, omit_defaults=True):
    """One operation of a step; `kind` says which of the optional parts it carries."""

    kind: str  # fwdbwd | sample | optim | create | save | load | unload | restore | persist
    adapter_id: str | None = None
    fwdbwd: FwdBwdF | None = None
    sample: SampleF | None = None
    load_from: str | None = None  # a sampler checkpoint to load as `adapter_id` first
    config: LoraConfig | None = None
    params: AdamParams | None = None
    dir: str | None = None
    optimizer: bool = False
    mark: int = 0  # the op's journal position (twinkled/journal.py); 0: changes nothing


class StepF(msgspec.Struct):
    id: int
    kind: str  # "train" | "sample" | "barrier" (as the planner says)
    ops: list[OpF]


class FwdBwdOutF(msgspec.Struct):
    rows: list[int]  # indices into the request's data that this rank ran
    outputs: list[dict[str, Buf]]
    metrics: dict[str, float]


class OutcomeF(msgspec.Struct, omit_defaults=True):
    index: int  # into the step's ops
    error: str | None = None
    category: str | None = None
    fwdbwd: FwdBwdOutF | None = None
    sample: SampleResult | None = None
    optim: OptimResult | None = None
    info: AdapterInfo | None = None
    digest: tuple[int, str] | None = None
    mark: int | None = None  # restore: the journal position of the version it loaded


class ReplyF(msgspec.Struct, tag="reply"):
    step: int
    rank: int
    outcomes: list[OutcomeF]
    memory: int = 0  # device bytes allocated after the step (0 on a CPU)
    persisted: dict[str, int] = {}  # adapter -> mark of the versions written since the last


class HelloF(msgspec.Struct, tag="hello"):
    """A worker's first frame: loaded (with what it knows of the model) or failed."""

    rank: int
    pid: int
    device: str
    model: dict[str, Any] = {}
    error: str | None = None


# One pair per direction, reused: building an encoder or decoder costs more than using it.
encoder = msgspec.msgpack.Encoder()
step_decoder = msgspec.msgpack.Decoder(StepF)
op_decoder = msgspec.msgpack.Decoder(OpF)
reply_decoder = msgspec.msgpack.Decoder(ReplyF | HelloF)


def to_frame(kind: str, args: dict) -> OpF:
    """An Op's arguments (engine dataclasses, lists of numbers) as a frame."""
    op = OpF(kind, adapter_id=args.get("adapter_id"), load_from=_str(args.get("load_from")),
             config=args.get("config"), params=args.get("params"), dir=_str(args.get("dir")),
             optimizer=bool(args.get("optimizer", False)))
    req = args.get("request")
    if isinstance(req, ForwardBackwardRequest):
        op.fwdbwd = _fwdbwd_frame(req)
    elif isinstance(req, SampleRequest):
        p = req.params
        op.sample = SampleF(req.adapter_id, buf(req.prompt), SamplingF(
            p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed,
            None if p.stop is None else list(p.stop)), req.num_samples, req.prompt_logprobs)
    return op


def _str(path: Any) -> str | None:
    return None if path is None else str(path)


def _fwdbwd_frame(req: ForwardBackwardRequest) -> FwdBwdF:
    if not isinstance(req.loss_fn, str):
        raise TypeError("a Python callable loss cannot be sent to a worker")
    return FwdBwdF(req.adapter_id, [_datum_frame(d) for d in req.data], req.loss_fn,
                   dict(req.loss_config), req.forward_only)


def _datum_frame(d: Datum) -> DatumF:
    return DatumF(buf(d.tokens), {k: buf(v) for k, v in d.loss_inputs.items()})


def as_result(kind: str, outcome: OutcomeF) -> Any:
    """The result object of one finished op (what the protocol layer encodes)."""
    if outcome.optim is not None:
        return outcome.optim
    if outcome.info is not None:
        return outcome.info
    if outcome.digest is not None:
        return tuple(outcome.digest)
    if outcome.sample is not None:
        return outcome.sample
    return None

