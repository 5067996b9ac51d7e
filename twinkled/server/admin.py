"""Administration: everything `twinkled ctl` does, in one place.

The daemon serves these methods at `POST /admin/v1/<command>` (JSON body = keyword
arguments) to whoever presents the admin key (`X-Admin-Key`; the key is created at the
first start in `<data_dir>/admin.key`, mode 0600). `twinkled ctl` calls that endpoint; when
no daemon answers it runs the same methods on the data directory itself, except `status`
and `drain`, which need the daemon.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path
from typing import Any

from twinkled.protocol.config import Config
from twinkled.server.admin_args import COMMANDS, AdminError, parse
from twinkled.store import Store
from twinkled.store.verify import all_checkpoints, offline_blobs, verify_checkpoints

ADMIN_KEY_PREFIX = "twa-"
__all__ = ["COMMANDS", "Admin", "AdminError"]

def admin_key_path(data_dir: Path, configured: str | None = None) -> Path:
    return Path(configured) if configured else Path(data_dir) / "admin.key"


def ensure_admin_key(path: Path) -> str:
    """The admin key, created (readable by its owner only) if there is none yet."""
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = ADMIN_KEY_PREFIX + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def same_key(given: str, expected: str) -> bool:
    digest = hashlib.sha256
    return hmac.compare_digest(digest(given.encode()).digest(), digest(expected.encode()).digest())


class Admin:
    """`service` is the running daemon's Service (None when ctl works on the data dir)."""

    def __init__(self, store: Store, data_dir: Path, service: Any = None):
        self.store, self.data_dir, self.service = store, Path(data_dir), service
        # where checkpoint files live: the daemon's store, else as a row's locator says
        self.blobs = service.blobs if service is not None else offline_blobs(self.data_dir)

    def run(self, command: str, args: dict | bytes) -> Any:
        """`args` checked at the door (admin_args.py), then the command's method."""
        kwargs = parse(command, args)  # first: an unknown command is refused by name
        return getattr(self, command)(**kwargs)

    # -- keys ---------------------------------------------------------------------------

    def keys_create(self, tenant: str) -> dict:
        if not tenant or "/" in tenant:
            raise AdminError(f"invalid tenant name {tenant!r}")
        self.store.tenants.ensure(tenant)
        return {"tenant": tenant, "key": self.store.tenants.create_key(tenant)}

    def keys_list(self, tenant: str | None = None) -> list[dict]:
        return self.store.tenants.list_keys(tenant)

    def keys_revoke(self, key: str) -> dict:
        """By the full key or the hash prefix `keys list` shows; effective on the next call."""
        try:
            revoked = self.store.tenants.revoke_key(key)
        except ValueError as e:
            raise AdminError(str(e)) from None
        if not revoked:
            raise AdminError(f"no active key matches {key[:16]!r}")
        return {"revoked": True}

    # -- tenants ------------------------------------------------------------------------

    def tenants_list(self) -> list[dict]:
        """Tenant rows, each with `storage_used_bytes` (checkpoints + user_metadata) and
        `storage_quota_bytes` (the quota in force, None for no limit). Without a running
        daemon the config file is unknown: the quota shown is the tenant's own, else the
        built-in default."""
        config = self.service.config if self.service is not None else Config()
        rows = self.store.tenants.list()
        for r in rows:
            r["storage_used_bytes"] = self.store.checkpoints.storage_used(r["name"])
            r["storage_quota_bytes"] = self.store.checkpoints.storage_quota(
                r["name"], config.storage_quota_default(r["name"]))
        return rows

    def tenants_set(self, name: str, weight: float | None = None, **limits: int | None) -> dict:
        row = self.store.tenants.set(name, weight, **limits)
        if self.service is not None:
            self.service.refresh_tenants()  # at once, not at the next housekeeping tick
        return row

    # -- runs ---------------------------------------------------------------------------

    def runs_list(self, tenant: str | None = None, limit: int = 1000) -> list[dict]:
        return self.store.runs.all(tenant, limit)

    def runs_show(self, run_id: str) -> dict:
        run = self.store.runs.get(run_id)
        if run is None:
            raise AdminError(f"no training run {run_id!r}")
        return {**run, "checkpoints": all_checkpoints(self.store, run_id=run_id)}

    def runs_delete(self, run_id: str) -> dict:
        """Soft-delete the run and unload its adapter; its checkpoints stay until deleted."""
        run = self.runs_show(run_id)
        if self.service is not None and run.get("live"):
            self.service.unload_models(run["tenant"], [run_id])
        self.store.runs.set_live(run_id, False)
        self.store.runs.delete(run_id)
        return {"deleted": run_id, "checkpoints_kept": len(run["checkpoints"])}

    # -- checkpoints --------------------------------------------------------------------

    def checkpoints_list(self, run: str | None = None, tenant: str | None = None,
                         status: str | None = None) -> list[dict]:
        return all_checkpoints(self.store, status=status, run_id=run, tenant=tenant)

    def checkpoints_verify(self) -> list[dict]:
        return verify_checkpoints(self.store, self.data_dir, self.blobs)

    def checkpoints_delete(self, path: str) -> dict:
        row = self.store.checkpoints.delete(path)
        if row is None:
            raise AdminError(f"no checkpoint {path!r}")
        if row.get("dir"):
            self.blobs.delete(row["dir"], quiet=True)
        return {"deleted": path}

    # -- the daemon ---------------------------------------------------------------------

    def status(self) -> dict:
        """The daemon's status; with none answering, the last one it wrote (every 2 s),
        marked `running: false` with its age, so a crashed daemon's last state shows."""
        if self.service is not None:
            return {**self.service.life.status(), "running": True}
        row = self.store.status.get()
        if row is None:
            raise AdminError("no daemon answers, and none has run on this data directory: "
                             "status needs the running daemon")
        return {**row["body"], "running": False,
                "age_seconds": round(time.time() - row["updated"], 1)}

    def drain(self, **_args) -> dict:
        """Served by the daemon itself (Service.drain); here only when none answers."""
        raise AdminError("no daemon answers: drain needs the running daemon")


def routes(app) -> None:
    """Mount POST /admin/v1/<command> (the auth middleware checks the admin key)."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        import asyncio

        command = request.match_info["command"]
        args = await request.read()
        service = app["service"]
        admin = Admin(app["store"], service.config.data_dir, service)
        if command == "drain":  # waits for the queues
            result = await service.life.drain(**parse(command, args))
        elif command == "checkpoints_verify":  # hashes files: off the event loop
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(None, admin.run, command, args)
        else:  # a few SQLite statements; they touch the scheduler, so on the loop
            result = admin.run(command, args)
        return web.json_response({"result": result, "time": time.time()})

    app.router.add_post("/admin/v1/{command}", handle)
