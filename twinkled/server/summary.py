"""The periodic one-line summary in the log (`log_summary_s`): tokens per second, steps,
queued requests and active tenants since the last line. Quiet while nothing happens, so an
idle daemon's log does not grow."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("twinkled")


def _counts(status: dict) -> tuple[int, int, dict[str, int]]:
    """Steps so far, tokens served so far, and each tenant's (tokens served so far)."""
    tenants = status.get("tenants", {})
    served = {name: int(t.get("served_tokens", 0)) for name, t in tenants.items()}
    return int(status.get("steps", 0)), sum(served.values()), served


def summary_line(before: dict, after: dict, seconds: float) -> dict | None:
    """The summary's fields between two `Service.status()` readings, or None when nothing
    ran and nothing waits."""
    steps0, tokens0, served0 = _counts(before)
    steps1, tokens1, served1 = _counts(after)
    queued = sum(int(t.get("queued_requests", 0)) for t in after.get("tenants", {}).values())
    active = sum(1 for name, t in after.get("tenants", {}).items()
                 if served1[name] > served0.get(name, 0) or t.get("queued_requests", 0))
    if steps1 == steps0 and not queued:
        return None
    return {"tok_s": round((tokens1 - tokens0) / max(seconds, 1e-9), 1),
            "steps": steps1 - steps0, "queued": queued, "tenants_active": active,
            "adapters": int(after.get("adapters", 0)), "interval_s": round(seconds, 1)}


async def log_summaries(status: Callable[[], dict], every_s: float) -> None:
    """Every `every_s` seconds, one line of what ran (until cancelled)."""
    before, then = None, time.monotonic()
    while True:
        try:
            after, now = status(), time.monotonic()
        except Exception:  # a status mid-start or mid-restart: the next interval reads again
            log.debug("summary skipped", exc_info=True)
            await asyncio.sleep(every_s)
            continue
        # (the first reading is only a start: one that raised used to end the task for good)
        fields = None if before is None else summary_line(before, after, now - then)
        if fields is not None:
            log.info("summary: %.1f tok/s, %d steps, %d queued, %d tenant(s) active, "
                     "%d adapter(s) in %.3g s", fields["tok_s"], fields["steps"],
                     fields["queued"], fields["tenants_active"], fields["adapters"],
                     fields["interval_s"], extra={"event": "summary", **fields})
        before, then = after, now
        await asyncio.sleep(every_s)
