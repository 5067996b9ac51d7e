"""What a forward_backward's datums cost a step when shared prefixes are computed once
(twinkled/engine/shared_prefix.py), for the planner: it fills steps by tokens and predicts
their time from them, and an RL group's rollouts of one prompt cost prompt + G x completion,
not G x (prompt + completion). Counting the rows' full lengths would fill a step with a
quarter of the work it can hold (512-token prompts, 128-token completions).

No torch here (the daemon's core): tokens are compared as the wire's bytes.
"""

from __future__ import annotations

from twinkled.protocol.frames import TrainF

TOKEN_BYTES = 8  # int64 on the wire


def common_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens two int64 token buffers share (a binary search of byte prefixes)."""
    lo, hi = 0, min(len(a), len(b)) // TOKEN_BYTES
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid * TOKEN_BYTES] == b[:mid * TOKEN_BYTES]:
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
            shared = common_tokens(d.tokens.data, before.data)
            shared = shared if shared == n else shared - 1  # the last one predicts anew
            shared = shared if shared >= min_shared else 0
        costs.append(max(1, n - shared))
        before = d.tokens
    return costs
