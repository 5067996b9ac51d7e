"""The ranks' answers to a step, merged into one outcome per op.

Who runs what (workers/runner.py): a training step's rows are split over the data-parallel
ranks, so a forward_backward's outputs come back in parts, one per rank that ran some of its
rows; a sample runs on one rank; a barrier runs on every rank, and rank 0's answer stands.
"""

from __future__ import annotations

from twinkled.core.ops import Outcome
from twinkled.protocol.frames import OpF, OutcomeF, ReplyF, TrainF, as_result
from twinkled.protocol.types import ForwardBackwardResult


def merge_replies(frames: list[OpF], replies: list[ReplyF]) -> list[Outcome]:
    """One outcome per op from the ranks' answers (see workers/runner.py for who runs what)."""
    per_op: list[list[OutcomeF]] = [[] for _ in frames]
    for reply in replies:  # rank order
        for o in reply.outcomes:
            per_op[o.index].append(o)
    merged = []
    for frame, got in zip(frames, per_op, strict=True):
        if not got:
            merged.append((None, "no worker answered for this request", "server"))
            continue
        failed = next((o for o in got if o.error is not None), None)
        if failed is not None:
            merged.append((None, failed.error, failed.category or "server"))
        elif isinstance(frame, TrainF):
            merged.append((join_rows(got), None, None))
        else:  # a sample ran on one rank; a barrier ran on all, rank 0's answer stands
            merged.append((as_result(got[0]), None, None))
    return merged


def join_rows(parts: list[OutcomeF]) -> ForwardBackwardResult:
    rows = sorted((j, out) for p in parts for j, out in zip(p.fwdbwd.rows, p.fwdbwd.outputs,
                                                             strict=True))
    metrics: dict[str, float] = {}
    for p in parts:
        for k, v in p.fwdbwd.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + v if k.endswith(":sum") else metrics.get(k, v)
    return ForwardBackwardResult(outputs=[out for _, out in rows], metrics=metrics)
