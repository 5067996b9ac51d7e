"""Tinker REST routes over what the store holds of a tenant's sessions: search
(RestClient.search_sessions), a session's trace (export_session_trace) and checkpoint
storage (AdminClient.get_current_checkpoint_storage_usage). A tenant only ever sees its own.
"""

from __future__ import annotations

import time

from aiohttp import web

from twinkled.protocol.errors import QuotaExceeded, UserError
from twinkled.protocol.sizing import human_size

from .common import body_of, iso_time, own_session, service
from .downloads import trace_url
from .messages import CreateSession, SessionSearch, StatusQuery, encoded_size

ACTIVE_WITHIN_S = 60.0  # clients heartbeat every 10 s: quiet for a minute, not known to run
FINISH_REASONS = ("success", "errored", "interrupted")  # the SDK's ClientSessionFinishReason
GB = 10**9  # the storage usage's billing unit: size_gigabytes is decimal gigabytes
# A session counts against tenant_max_sessions until it finishes or its client has been
# quiet this long (the tinker client heartbeats every 10 s): a client that died without
# finishing frees its place by itself; the row stays (search, trace).
OPEN_WITHIN_S = 600.0


def new_session(request, body: CreateSession, user_metadata: dict) -> str:
    """A new session of the caller, within its open-session cap and its storage quota
    (what the session stores counts in it). Both refusals are 400s: the tinker client
    does not retry them."""
    tenant, store, config = request["tenant"], request.app["store"], service(request).config
    cap = config.tenant_max_sessions
    if cap and store.sessions.open_count(tenant, time.time() - OPEN_WITHIN_S) >= cap:
        raise UserError(f"tenant {tenant!r} has {cap} open sessions, the most it may have "
                        "(tenant_max_sessions): finish some (ServiceClient, or let their "
                        f"clients exit; a session quiet for {OPEN_WITHIN_S:.0f} s no "
                        "longer counts)")
    # sdk_version and display_name are small (bounded at the door) and counted, but refused
    # for no quota: a tenant over it still opens the session it deletes checkpoints with.
    size = len(encoded_size(user_metadata)) if user_metadata else 0
    quota = store.checkpoints.storage_quota(tenant, config.storage_quota_default(tenant))
    used = store.checkpoints.storage_used(tenant) if quota and size else 0
    if quota and size and used + size > quota:
        raise QuotaExceeded(f"tenant {tenant!r} uses {human_size(used)} of its "
                            f"{human_size(quota)} storage quota, and this session would "
                            f"store {human_size(size)} more (user_metadata): delete "
                            "checkpoints or ask the operator to raise it")
    return store.sessions.create(tenant, user_metadata, body.sdk_version, body.display_name)


def session_status(s: dict, at: float) -> dict | None:
    """SessionStatus: finished (with the client's reason), active (heartbeating), or None
    (neither finished nor known to be running, as the SDK defines it)."""
    if s.get("finished_at"):
        reason = s.get("finish_reason")
        if reason not in FINISH_REASONS:  # finished before the daemon kept reasons
            return None
        return {"type": "client_finished", "reason": {"type": reason}, "detail": None}
    if at - (s.get("last_heartbeat") or 0) <= ACTIVE_WITHIN_S:
        return {"type": "active"}
    return None


def _status_matches(status: dict | None, queries: list[StatusQuery]) -> bool:
    for q in queries:
        if status is not None and q.type == status["type"]:
            if q.type != "client_finished" or not q.reasons:
                return True
            if status["reason"]["type"] in q.reasons:
                return True
    return False


def _matches(q: SessionSearch, s: dict, status: dict | None) -> bool:
    if q.session_id is not None or q.display_name is not None:  # either one, as the SDK says
        by_id = q.session_id is not None and s["id"] == q.session_id
        name = (s.get("display_name") or "").casefold()
        by_name = q.display_name is not None and all(
            w in name for w in q.display_name.casefold().split())
        if not (by_id or by_name):
            return False
    meta = s.get("user_metadata") or {}
    if any(meta.get(k) != v for k, v in q.user_metadata.items()):
        return False
    return q.statuses is None or _status_matches(status, q.statuses)


def session_summary(s: dict, status: dict | None, ckpts: tuple[int, int]) -> dict:
    return {"session_id": s["id"], "created_at": iso_time(s["created"]), "owner": s["tenant"],
            "project_id": "",  # no projects here
            "status": status, "checkpoints_count": ckpts[0], "display_name": s.get("display_name"),
            "user_metadata": s.get("user_metadata") or None, "checkpoint_storage_bytes": ckpts[1]}


async def search_sessions(request):
    """The caller's sessions that match, newest first, one page and a cursor to the next."""
    q = await body_of(request, SessionSearch)
    tenant, store = request["tenant"], request.app["store"]
    if q.project_ids:
        raise UserError("project_ids: projects are not supported by this server")
    if q.owner.type == "user" and tenant not in (q.owner.owner_urns or []):
        return web.json_response({"sessions": [], "next_cursor": None})  # only one's own
    cursor = None
    if q.cursor is not None:
        cursor = (round(q.cursor.last_created_at.timestamp() * 1e6), q.cursor.last_session_id)
    at, found = time.time(), []
    while len(found) <= q.limit:  # one more than a page: is there a next one?
        rows = store.sessions.before(tenant, cursor, 200)
        for s in rows:
            status = session_status(s, at)
            if _matches(q, s, status):
                found.append((s, status))
        if len(rows) < 200:
            break
        cursor = (rows[-1]["created_us"], rows[-1]["id"])
    page, more = found[:q.limit], len(found) > q.limit
    ckpts = store.sessions.checkpoint_usage([s["id"] for s, _ in page])
    next_cursor = None
    if more:
        last = page[-1][0]
        next_cursor = {"last_created_at": iso_time(last["created_us"] / 1e6),
                       "last_session_id": last["id"]}
    return web.json_response({
        "sessions": [session_summary(s, st, ckpts.get(s["id"], (0, 0))) for s, st in page],
        "next_cursor": next_cursor})


async def export_session_trace(request):
    """The trace is built when its URL is fetched, from what the store holds then: always
    "ready" at once (the SDK polls while "pending")."""
    s = own_session(request, request.match_info["session_id"])
    return web.json_response({"status": "ready", "url": trace_url(request, s["id"])})


def _us(t: float) -> int:
    return round(t * 1e6)


def build_trace(store, session_id: str) -> dict:
    """A session as a Chrome trace-event JSON document (Perfetto and chrome://tracing open
    it): one track for the session, one per run and sampler with its requests as spans
    (the futures the store still holds: 10 minutes after they finish), and its checkpoints
    as instants."""
    s = store.sessions.get(session_id)
    if s is None:  # deleted since the URL was signed: an empty trace, not an error page
        return {"traceEvents": []}
    rows, at = store.sessions.trace_rows(session_id), time.time()
    ends: dict[str | None, float] = {}  # track -> when its last request finished
    for f in rows["futures"]:
        ends[f["model_id"]] = max(ends.get(f["model_id"], 0), f["completed_at"] or at)
    events: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name",
                           "args": {"name": f"session {session_id}"}}]

    def track(tid: int, name: str, start: float, end: float, args: dict) -> None:
        events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name",
                       "args": {"name": name}})
        events.append({"ph": "X", "pid": 1, "tid": tid, "name": name.split()[0],
                       "ts": _us(start), "dur": max(1, _us(end) - _us(start)), "args": args})

    end = max(s.get("finished_at") or s.get("last_heartbeat") or 0, *ends.values(), s["created"])
    track(0, "session", s["created"], end, {
        "display_name": s.get("display_name"), "user_metadata": s.get("user_metadata"),
        "finish_reason": s.get("finish_reason")})
    tids: dict[str, int] = {}
    for kind, row in [("run", r) for r in rows["runs"]] + [("sampler", r) for r in rows["samplers"]]:
        tids[row["id"]] = len(tids) + 1
        last = max(row.get("last_request_time") or 0, ends.get(row["id"], 0), row["created"])
        track(tids[row["id"]], f"{kind} {row['id']}", row["created"], last, {
            "base_model": row["base_model"], "lora_rank": row.get("lora_rank"),
            "model_path": row.get("model_path")})
    for f in rows["futures"]:
        done = f["completed_at"] or at
        events.append({"ph": "X", "pid": 1, "tid": tids.get(f["model_id"], 0), "name": f["kind"],
                       "ts": _us(f["created"]), "dur": max(1, _us(done) - _us(f["created"])),
                       "args": {"request_id": f["id"], "status": f["status"]}})
    for c in rows["checkpoints"]:
        events.append({"ph": "i", "s": "t", "pid": 1, "tid": tids.get(c["run_id"], 0),
                       "name": f"checkpoint {c['kind']}/{c['name']}", "ts": _us(c["created"]),
                       "args": {"tinker_path": c["tinker_path"], "status": c["status"],
                                "size_bytes": c["size_bytes"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"session_id": session_id, "owner": s["tenant"]}}


async def checkpoint_storage_usage(request):
    """The caller's ready checkpoints and their bytes (one row: this daemon has no projects,
    organisations or prices)."""
    if request.query.get("project_id"):
        raise UserError("project_id: projects are not supported by this server")
    tenant = request["tenant"]
    count, size = request.app["store"].checkpoints.usage(tenant)
    return web.json_response({"effective_rate_usd_per_gigabyte_month": None, "data": [{
        "project_id": None, "org_user_urn": tenant, "user_email": None, "user_name": tenant,
        "checkpoint_count": count, "size_bytes": size, "size_gigabytes": size / GB,
        "estimated_monthly_cost_usd": None}]})


def add_session_routes(app: web.Application, v1: str) -> None:
    r = app.router
    r.add_post(f"{v1}/sessions/search", search_sessions)
    r.add_get(f"{v1}/sessions/{{session_id}}/trace_export", export_session_trace)
    r.add_get(f"{v1}/billing/usage/checkpoints/current", checkpoint_storage_usage)
