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

from twinkled.protocol.images import VisionSpec
from twinkled.protocol.types import (
    AdamParams,
    AdapterInfo,
    DimuonParams,
    LogprobGap,
    LoraConfig,
    OptimResult,
    SampledSequence,
    SampleResult,
)

_TYPECODES = {"int64": "q", "float32": "f"}
# An outcome's category when the op could not run because a pass it shared failed: the
# daemon restores that pass's adapters and runs its ops one at a time (executor.py).
RETRY = "retry"


class Buf(msgspec.Struct, array_like=True):
    dtype: str  # "int64" | "float32"
    shape: list[int]
    data: bytes

    def values(self) -> list:
        a = array(_TYPECODES[self.dtype])
        a.frombytes(self.data)
        return a.tolist()


def buf(values: Any, dtype: str | None = None, shape: list[int] | None = None) -> Buf:
    """Numbers as a Buf: of `dtype` if given (the wire's), else int64 when every value is an
    int and float32 otherwise; 1-D unless `shape` (row-major) says otherwise."""
    if isinstance(values, Buf):
        return values
    if dtype is not None:
        a = array(_TYPECODES[dtype], values)
    elif isinstance(values, array):
        a = values if values.typecode in ("q", "f") else array("f", values)
    else:
        try:
            a = array("q", values)
        except (TypeError, OverflowError):  # floats (or ints too large): the engine says so
            a = array("f", values)
    return Buf("int64" if a.typecode == "q" else "float32",
               [len(a)] if shape is None else list(shape), a.tobytes())


class ImageF(msgspec.Struct, array_like=True):
    """One image of a VL model's datum, checked at the door (protocol/images.py); the
    worker cuts it into patches (the door stays torch-free)."""
    data: bytes  # as the client sent it (png or jpeg)
    format: str
    grid: list[int]  # (t, h, w) patches
    tokens: int  # its placeholder tokens
    digest: bytes  # its encoded bytes' hash
    spec: VisionSpec  # the model's image processor settings


class DatumF(msgspec.Struct, array_like=True):
    tokens: Buf
    inputs: dict[str, Buf]
    images: list[ImageF] = []


class SamplingF(msgspec.Struct):
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: list[str | int] | None


# -- the operations of a step: one struct per kind, told apart by their "kind" tag ----------
# The runner dispatches on the type; `mark` is the op's journal position (twinkled/core/journal.py;
# 0: it changes no adapter state).

class _Op(msgspec.Struct, tag_field="kind", omit_defaults=True):
    adapter_id: str | None


class TrainF(_Op, tag="fwdbwd"):
    """A forward/backward request (or a piece of one), checked at the daemon's door."""

    data: list[DatumF]
    loss_fn: str
    loss_config: dict[str, float] = {}
    forward_only: bool = False
    mark: int = 0


class SampleF(_Op, tag="sample"):
    prompt: Buf
    params: SamplingF
    num_samples: int = 1
    prompt_logprobs: bool = False
    load_from: str | None = None  # a sampler checkpoint to load as `adapter_id` first
    # What else to score (engine.types.SampleRequest says what each is).
    prompt_last_n: int | None = None
    topk_prompt: int = 0
    topk_sample: int = 0
    target_prompt: Buf | None = None  # int64 [len(prompt) - 1, K]; -1: nothing
    alt_tokens_k: int = 0
    images: list[ImageF] = []  # a VL model's, in placeholder order (protocol/images.py)
    # Set by the daemon when it queues the op: the name its outcome and pieces come back
    # under (a sample may finish steps after the one that brought it), and whether its
    # reader streams it (then the workers send its new tokens after each slice).
    key: str = ""
    stream: bool = False


class CreateF(_Op, tag="create"):
    config: LoraConfig
    mark: int = 0


class OptimF(_Op, tag="optim"):
    params: AdamParams | DimuonParams  # of the family the adapter was created with
    mark: int = 0


class SaveF(_Op, tag="save"):
    dir: str
    optimizer: bool = False
    # Sampler weights: every rank also keeps a device copy, which the first sample from
    # this checkpoint uses instead of reading the files back (runner.StepRunner).
    sampler: bool = False


class LoadF(_Op, tag="load"):
    dir: str
    optimizer: bool = False
    optimizer_type: str | None = None  # a new adapter's family (engine.Engine.load)
    mark: int = 0


class UnloadF(_Op, tag="unload"):
    """Free a finished adapter (its journal goes too)."""


class IdleUnloadF(_Op, tag="idle_unload"):
    """Persist an idle adapter, then free it; a RestoreF brings it back."""


class ParkF(_Op, tag="park"):
    """Move an adapter's whole state (weights, gradients, moments) out of the GPU bank into
    the worker's host memory, exactly; an UnparkF brings it back, an IdleUnloadF moves it on
    to disk (core/tiers.py says when)."""


class UnparkF(_Op, tag="unpark"):
    """An adapter parked in host memory back into the GPU bank, as it was."""


class PersistF(_Op, tag="persist"):
    """Everything of this adapter on disk before the answer (a hot restart)."""


class RestoreF(_Op, tag="restore"):
    """An adapter from its last persisted state under `dir` (fresh from `config` if none)."""

    config: LoraConfig
    dir: str | None = None


OpF = TrainF | SampleF | CreateF | OptimF | SaveF | LoadF | UnloadF | IdleUnloadF | PersistF \
    | RestoreF | ParkF | UnparkF
# Ops that change their adapter take a journal position before they run.
JOURNALED = (TrainF, CreateF, OptimF, LoadF)


def kind_of(op: msgspec.Struct) -> str:
    """An op's tag ("fwdbwd", "optim", ...): what the planner and the metrics call it."""
    return op.__struct_config__.tag


def changes_adapter(op: OpF) -> bool:
    """Does the op change its adapter's state (so it takes a journal position)?"""
    if isinstance(op, TrainF):
        return op.adapter_id is not None and not op.forward_only
    return isinstance(op, JOURNALED)


class StepF(msgspec.Struct, omit_defaults=True):
    id: int
    # "train" | "sample" | "barrier" (as the planner says) | "slice" | "nudge" (no step, and
    # no answer: a rank decoding a slice with `slice_max_s` ends it once `slice_s` passed)
    kind: str
    ops: list[OpF]
    # Sampling ("sample": new ops, "slice": none): decode for up to `slice_s` seconds, or
    # until a sample finished, then answer with those that finished (0: run this step's
    # samples to completion). (`slice_max_s` below.)
    slice_s: float = 0.0
    cancel: list[str] = []  # keys of samples to drop (their clients went away)
    hold: list[str] = []  # sampler adapters that samples still use: never evicted now
    # A training step's micro-batches hold at most this many tokens (0: the engine's
    # token_budget), and between them the rank runs any "join" step sent meanwhile (a
    # small tenant's work, answered at once; EngineCore._joins), so it waits one
    # micro-batch, not the whole step.
    micro_tokens: int = 0
    # A join (sent into the training step in flight): run inside it, or right after it if it
    # came too late, but never taken as the sign that the steps before it were answered.
    join: bool = False
    # Sampling: (> slice_s) nothing else waited when this was sent, so decode on up to this
    # long, unless a "nudge" comes (work arrived): then stop once `slice_s` passed.
    slice_max_s: float = 0.0


class SlicedF(msgspec.Struct, omit_defaults=True):
    """A rank's sampling after a "sample" or "slice" step, beside its finished outcomes."""

    running: list[str] = []  # keys of the samples it still decodes (or holds queued)
    waiting: int = 0  # of those, requests that wait for room in its running batch
    pieces: dict[str, list[SampledSequence]] = {}  # streamed keys: tokens since the last
    # It holds a batch's worth of rows waiting (or a request that waits for the batch to
    # empty): new samples had better wait in the daemon's queues (PendingSamples.backlog).
    stocked: bool = False


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
    key: str = ""  # a sample's SampleF.key (its index is -1 if it came in an earlier step)


class ReplyF(msgspec.Struct, tag="reply"):
    step: int
    rank: int
    outcomes: list[OutcomeF]
    memory: int = 0  # device bytes allocated after the step (0 on a CPU)
    peak_memory: int = 0  # the most device bytes allocated since the worker started
    persisted: dict[str, int] = {}  # adapter -> mark of the versions written since the last
    busy_s: float = 0.0  # seconds the rank spent running the step (the rest is transport)
    began: float = 0.0  # wall-clock time the rank started the step (for twinkled/protocol/trace.py)
    phases: dict[str, float] = {}  # host seconds by phase inside the step (engine.step.HostTime)
    sampling: SlicedF | None = None  # after a "sample" or "slice" step
    # Sampler vs trainer logprobs of the samples checked since the last reply (workers/gaps.py)
    gaps: list[LogprobGap] = []


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


def datum_frame(tokens: Any, inputs: dict[str, Any]) -> DatumF:
    """A datum's token ids and loss inputs (lists, arrays or Bufs) as a frame."""
    return DatumF(buf(tokens, "int64"), {k: buf(v) for k, v in inputs.items()})


def as_result(outcome: OutcomeF) -> Any:
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

