"""What a tenant may store through sessions (issue 28 item 7): `sdk_version` bounded,
session `user_metadata` counted against the storage quota when the session is made, and
open sessions capped per tenant (`tenant_max_sessions`), all refused with a 400 that the
unmodified tinker client does not retry."""

from __future__ import annotations

import os

import httpx
import pytest

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

T = 60
CAP = 256  # tenant_max_sessions' default


def _admin(daemon) -> httpx.Client:
    key = (daemon.data / "admin.key").read_text().strip()
    return httpx.Client(base_url=f"{daemon.url}/admin/v1", headers={"X-Admin-Key": key},
                        timeout=T)


def _tenant(daemon, name: str, **quotas) -> httpx.Client:
    """A tenant of its own on the shared daemon; an httpx client with its key."""
    with _admin(daemon) as admin:
        key = admin.post("/keys_create", json={"tenant": name}).json()["result"]["key"]
        if quotas:
            assert admin.post("/tenants_set", json={"name": name, **quotas}).status_code == 200
    return httpx.Client(base_url=f"{daemon.url}/api/v1", headers={"X-API-Key": key},
                        timeout=T)


def _open(daemon, tiny_dir, key: str, **kw):
    """A ServiceClient that has made its session (the SDK makes it on first use)."""
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=key, **kw)
    sc.create_sampling_client(base_model=tiny_dir.name)
    return sc


def _used(daemon, name: str) -> int:
    with _admin(daemon) as admin:
        rows = admin.post("/tenants_list", json={}).json()["result"]
    return next(r["storage_used_bytes"] for r in rows if r["name"] == name)


def test_session_strings_are_bounded_and_counted_in_the_storage_quota(daemon, tiny_dir):
    http = _tenant(daemon, "sess-quota", max_storage_bytes=200_000)
    key = http.headers["X-API-Key"]
    r = http.post("/create_session", json={"sdk_version": "x" * (10 << 20)})
    assert r.status_code == 400 and "sdk_version" in r.json()["detail"]
    before = _used(daemon, "sess-quota")
    assert http.post("/create_session", json={"sdk_version": "0.38.0"}).status_code == 200
    assert _used(daemon, "sess-quota") >= before + len("0.38.0")  # and metadata "{}"
    # user_metadata of 60 KB a session: the fourth would pass the 200 KB quota.
    meta = {"note": "x" * 60_000}
    for _ in range(3):
        _open(daemon, tiny_dir, key, user_metadata=meta)
    with pytest.raises(tinker.BadRequestError, match="storage quota"):
        _open(daemon, tiny_dir, key, user_metadata=meta)
    assert _used(daemon, "sess-quota") <= 200_000
    # At its quota, the tenant still opens a session without metadata.
    _open(daemon, tiny_dir, key)
    http.close()


def test_open_sessions_are_capped_per_tenant_and_a_finished_one_frees_its_place(daemon,
                                                                                tiny_dir):
    http = _tenant(daemon, "sess-cap")
    key = http.headers["X-API-Key"]
    sids = [http.post("/create_session", json={}).json()["session_id"] for _ in range(CAP)]
    r = http.post("/create_session", json={})
    assert r.status_code == 400 and "tenant_max_sessions" in r.json()["detail"]
    with pytest.raises(tinker.BadRequestError, match="open sessions"):  # not retried
        _open(daemon, tiny_dir, key)
    assert http.post(f"/sessions/{sids[0]}/finish", json={}).status_code == 204
    _open(daemon, tiny_dir, key)
    # Another tenant is not capped by this one's sessions.
    with _tenant(daemon, "sess-other") as other:
        assert other.post("/create_session", json={}).status_code == 200
    http.close()
