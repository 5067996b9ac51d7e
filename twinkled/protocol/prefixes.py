"""Common starts of token sequences, compared as bytes (in C, no torch: the daemon's core
uses it too), and what a forward_backward's datums cost a step when shared prefixes are
computed once (twinkled/engine/shared_prefix.py).

The planner fills steps by tokens and predicts their time from them; an RL group's
rollouts of one prompt cost prompt + G x completion, not G x (prompt + completion).
Counting the rows' full lengths would fill a step with a quarter of the work it can hold
(512-token prompts, 128-token completions).
"""

from __future__ import annotations

from twinkled.protocol.frames import TrainF

TOKEN_BYTES = 8  # int64 on the wire


def common_units(a: bytes, b: bytes, unit: int = TOKEN_BYTES) -> int:
    """Leading units of `unit` bytes (int64 tokens by default) that a and b share: a binary
    search of byte prefixes, each compared in C."""
    lo, hi = 0, min(len(a), len(b)) // unit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid * unit] == b[:mid * unit]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def datum_costs(frame: TrainF, min_shared: int) -> list[int]:
    """Each datum's tokens, less what it shares with the datum before it (the positions
    before the last shared token: the engine computes those once) where that is at least
    `min_shared`. Clients send a prompt's rollouts one after another; a datum that shares
    with an earlier, not adjacent one is counted whole (an overestimate, never under)."""
    costs, before = [], None
    for d in frame.data:
        n = d.tokens.shape[0]
        shared = 0
        if min_shared > 0 and before is not None and d.tokens.dtype == before.dtype == "int64":
            shared = common_units(d.tokens.data, before.data)
            shared = shared if shared == n else shared - 1  # the last one predicts anew
            shared = shared if shared >= min_shared else 0
        costs.append(max(1, n - shared))
        before = d.tokens
    return costs
