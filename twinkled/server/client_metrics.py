"""A client reports numbers of its own run that the daemon cannot see (an RL loop's reward
mean, an eval score), per step of its own counting; the console draws them beside the
curves the daemon records (store/steps.py, `ClientMetrics`).

    POST /twinkle/v1/runs/{run_id}/metrics
    {"points": [{"step": 3, "metrics": {"reward/mean": 0.41, "kl": 0.02}}, ...]}

The body is checked at the door, as one typed message (names, counts and values bounded
below; JSON has no NaN, and a number past a float's range is refused as it is read);
the run must be the caller's (404 otherwise, as everywhere); a tenant's key only
(the admin key reads the console, it does not write a tenant's curves).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from aiohttp import web
from msgspec import Meta

from tinker_shim.messages import decode
from twinkled.protocol.errors import NotFound, UserError

ROUTE = "/twinkle/v1/runs/{run_id}/metrics"
MAX_POINTS = 1000  # steps in one request
MAX_NAMES = 64  # metrics of one step
MAX_STEP = 2**31 - 1
MAX_BYTES = 1 << 20  # of one request's body

# A name as W&B and TensorBoard write them ("reward/mean", "env.score"): printable ASCII
# without spaces, at most 128 characters.
Name = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[!-~]+$")]


class Point(msgspec.Struct, forbid_unknown_fields=True):
    step: Annotated[int, Meta(ge=0, le=MAX_STEP)]
    metrics: Annotated[dict[Name, float], Meta(min_length=1, max_length=MAX_NAMES)]


class Report(msgspec.Struct, forbid_unknown_fields=True):
    points: Annotated[list[Point], Meta(min_length=1, max_length=MAX_POINTS)]


async def report(request: web.Request) -> web.Response:
    raw = await request.read()
    if len(raw) > MAX_BYTES:
        raise UserError(f"the body is {len(raw)} bytes; a report takes at most {MAX_BYTES} "
                        "(send its points in several)")
    body = decode(raw, Report)
    run_id = request.match_info["run_id"]
    store = request.app["store"]
    run = store.runs.get(run_id)
    if run is None or run["tenant"] != request["tenant"]:
        raise NotFound(f"no training run {run_id!r}")
    store.client_metrics.report(run_id, [(p.step, p.metrics) for p in body.points])
    return web.json_response({"run_id": run_id, "points": len(body.points)})


def add_routes(app: web.Application) -> None:
    app.router.add_post(ROUTE, report)
