"""Page-locked host memory that takes what it holds, and no more.

torch's pinned-memory allocator rounds every allocation up to a power of two. The host tier
(workers/parked.py) keeps hundreds of adapters' states there: a rank-32 0.5B adapter's
211 MB snapshot takes 256 MiB and its 70 MB of gradients 128 MiB, 1.37x what the tier
counts. A 1,000-run bench (issue 33) filled 160 GiB of host budget with 235 GiB of pinned
memory, and the kernel killed the worker. Builds that have `pinned_max_round_threshold_mb`
are told to give large allocations their exact size (`exact_sizes`); on others,
`pinned_bytes` counts the rounding, so the host tier's cap (`HostTier(max_bytes)`) holds.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("twinkled")

ROUND_BELOW_MB = 16  # allocations up to this size keep the power-of-two rounding (reuse)
_exact: bool | None = None


def exact_sizes() -> bool:
    """Whether large pinned allocations take their exact size in this process: asked for
    once (the first time on a CUDA machine), then checked with one allocation: builds
    without the option refuse it (torch 2.11) or may take it without a word. Never raises."""
    global _exact
    if _exact is None:
        _exact = torch.cuda.is_available() and _ask_for_exact()
        if torch.cuda.is_available() and not _exact:
            log.warning("this torch build rounds pinned host memory up to powers of two "
                        "(no pinned_max_round_threshold_mb): the host tier counts the rounding")
    return _exact


def _ask_for_exact() -> bool:
    try:
        torch._C._accelerator_setAllocatorSettings(
            f"pinned_max_round_threshold_mb:{ROUND_BELOW_MB}")
        stats = torch.cuda.host_memory_stats
        before = stats().get("allocated_bytes.current")
        n = (ROUND_BELOW_MB + 1) * 2**20 + 4096
        probe = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        after = stats().get("allocated_bytes.current")
        del probe
    except (AttributeError, RuntimeError, ValueError):  # (2.11: "Unrecognized key", a
        return False                                     # ValueError; 2.13 takes it)
    return before is not None and after is not None and after - before < 2 * n * 3 // 4


def pinned_bytes(nbytes: int) -> int:
    """The host memory a pinned allocation of `nbytes` takes (exact where `exact_sizes`
    holds for its size, else the next power of two). Off CUDA: `nbytes` (not pinned)."""
    if not torch.cuda.is_available() or nbytes <= 0:
        return max(nbytes, 0)
    if nbytes > ROUND_BELOW_MB * 2**20 and exact_sizes():
        return nbytes
    return 1 << (nbytes - 1).bit_length()
