"""Files the daemon hands out itself, at signed URLs that expire.

`GET .../external_weights_urls` (RestClient.get_external_weights_urls, `tinker checkpoint
download`) answers one URL per file of an external weights checkpoint; a session's trace
export answers one URL for its trace. Those clients fetch the URLs with plain urllib and no
API key, so the URL itself is the credential: it names what it gives, until when, and an
HMAC-SHA256 of both under a secret of this daemon (`<data_dir>/download.key`, 0600). A URL
whose signature does not match (tampered, or its checkpoint was deleted or saved again,
identical weights or not) or
whose time has passed is refused with a 403 that says which, and nothing about what exists.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import json
import os
import re
import secrets
import tarfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import formatdate
from functools import cache, partial
from pathlib import Path
from urllib.parse import quote

from aiohttp import web

from twinkled.protocol.blobs import StoreError
from twinkled.protocol.checkpoints import checkpoint_path
from twinkled.protocol.errors import UserError

from .ids import ALL_KINDS, valid_name

V1 = "/api/v1"
PREFIX = f"{V1}/download/"  # no API key on these routes: the signature is checked instead
URL_TTL_S = 3600  # how long a signed URL works; the tinker CLI asks again before it ends
_EXPIRES = re.compile(r"[0-9]{1,12}")  # unix seconds, digits only (int() takes "+1_0 ")


@cache
def download_key(data_dir: Path) -> bytes:
    """This daemon's signing secret, created on first use (readable by its owner only)."""
    path = Path(data_dir) / "download.key"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:  # copied in loosely: tighten it, as the data dir is
            path.chmod(0o600)
        return bytes.fromhex(path.read_text().strip())
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return bytes.fromhex(path.read_text().strip())


def sign(key: bytes, what: str, expires: int) -> str:
    """The signature of a URL: HMAC-SHA256 of what it gives and until when."""
    return hmac.new(key, f"{what}\n{expires}".encode(), hashlib.sha256).hexdigest()


def _signature(request: web.Request, what: str, expires: int) -> str:
    return sign(download_key(request.app["service"].config.data_dir), what, expires)


def _base(request: web.Request) -> str:
    """The scheme and host the client reached us at (its Host header), so the URL works
    from where the client is, whatever address the daemon listens on."""
    try:
        return str(request.url.origin())
    except ValueError:  # a Host header yarl cannot parse: the address we listen on
        cfg = request.app["service"].config
        return f"http://{cfg.host}:{cfg.port}"


def signed_url(request: web.Request, route: str, what: str) -> tuple[str, int]:
    """(URL of `route` under PREFIX, signed for `what`, and its expiry in unix seconds)."""
    expires = int(time.time()) + URL_TTL_S
    sig = _signature(request, what, expires)
    return f"{_base(request)}{PREFIX}{route}?expires={expires}&sig={sig}", expires


def check_signature(request: web.Request, what: str) -> None:
    """403 unless the URL's signature is this daemon's for `what` and has not expired."""
    raw = request.query.get("expires", "")
    expires = int(raw) if _EXPIRES.fullmatch(raw) else -1
    given = request.query.get("sig", "")
    if (expires < 0 or not given.isascii()
            or not hmac.compare_digest(given, _signature(request, what, expires))):
        _forbidden("this download link is not valid: it was altered, or what it points to "
                   "was deleted or saved again; ask for new URLs")
    if expires < time.time():
        _forbidden(f"this download link expired at {_iso(expires)}; ask for new URLs "
                   "(get_external_weights_urls, or export_session_trace)")


def _forbidden(message: str):
    raise web.HTTPForbidden(text=json.dumps({"detail": message}), content_type="application/json")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def _q(part: str) -> str:
    return quote(part, safe=":@+=,")


# -- external weights ------------------------------------------------------------------

async def _files(request: web.Request, checkpoint: dict) -> list[str]:
    """The files of a checkpoint (no subdirectories, no temporary files), wherever its
    store keeps them (twinkled/protocol/blobs.py; an object store's listing off the loop)."""
    blobs = request.app["service"].blobs
    try:
        return sorted(await asyncio.get_running_loop().run_in_executor(
            None, blobs.files, checkpoint["dir"]))
    except StoreError as e:
        _unavailable(str(e))
    except OSError:
        return []


async def _local(request: web.Request, checkpoint: dict) -> Path:
    """A local directory with the checkpoint's files: an object store's version fetched
    into the daemon's cache (protocol/blobs.py), off the event loop."""
    try:
        return await asyncio.get_running_loop().run_in_executor(
            None, request.app["service"].blobs.local, checkpoint["dir"])
    except StoreError as e:
        _unavailable(str(e))


def _unavailable(message: str):
    """The checkpoint store is out of reach now: a 503 the client may retry."""
    raise web.HTTPServiceUnavailable(text=json.dumps({"detail": message}),
                                     content_type="application/json")


async def external_weights_urls(request: web.Request, checkpoint: Callable) -> web.Response:
    """One signed URL per file of the caller's own external weights checkpoint."""
    c = checkpoint(request)
    if c["kind"] != "external_weights":
        raise UserError("download URLs are given for external weights checkpoints only "
                        "(tinker://<run_id>/external_weights/<name>): export one with "
                        "TrainingClient.save_weights_external")
    files = await _files(request, c)
    if not files:
        raise UserError(f"checkpoint {c['tinker_path']!r} has no files on disk")
    urls, expires = {}, 0
    for name in files:
        route = "/".join(_q(p) for p in ("checkpoints", c["run_id"], c["kind"], c["name"], name))
        urls[name], expires = signed_url(request, route, file_subject(c, name))
    return web.json_response({"urls": urls, "expires": _iso(expires)})


def file_subject(checkpoint: dict, file: str) -> str:
    """What a file's URL gives: that file of this version of the checkpoint. The version
    is its sha256 and the time it was saved: once the checkpoint is saved again (even with
    identical weights) or deleted, its old links stop working."""
    return (f"file\n{checkpoint['tinker_path']}\n{file}\n{checkpoint['sha256']}\n"
            f"{checkpoint['created']!r}")


def _signed_checkpoint(request: web.Request, subject: Callable[[dict], str]) -> dict:
    """The checkpoint a signed download URL names (403 unless signed for it, as it is)."""
    m = request.match_info
    run_id, kind, name, file = m["run_id"], m["kind"], m["name"], m.get("file", "")
    c = None
    if kind in ALL_KINDS and (not file or valid_name(file)):
        try:
            c = request.app["store"].checkpoints.get(checkpoint_path(run_id, kind, name))
        except ValueError:  # not a path this daemon could have signed
            c = None
    if c is None or c["status"] != "ready":
        c = {"tinker_path": f"{run_id}/{kind}/{name}", "sha256": "", "created": None,
             "dir": ""}
    check_signature(request, subject(c))
    return c


async def download_file(request: web.Request) -> web.StreamResponse:
    file = request.match_info["file"]
    c = _signed_checkpoint(request, lambda c: file_subject(c, file))
    path = (await _local(request, c)) / file
    if not path.is_file():  # signed, but the file is gone (cannot happen short of a hand)
        raise web.HTTPNotFound(text='{"detail": "file not found"}',
                               content_type="application/json")
    return web.FileResponse(path, headers={
        "Content-Disposition": f'attachment; filename="{file}"'})


# -- checkpoint archives (SDK <= 0.35) -------------------------------------------------

# The old CLI (`tinker checkpoint download`, push-hf) wants this file in the archive, beside
# the PEFT files, as the mark of a complete checkpoint (ours are complete once "ready").
COMPLETE_MARK = "checkpoint_complete"


async def archive_url(request: web.Request, checkpoint: Callable) -> web.Response:
    """GET .../checkpoints/{checkpoint_id}/archive: SDK <= 0.35's RestClient answers a 302
    to a tar of the checkpoint (its PEFT files) with a signed URL, when it expires in
    `Expires` (an HTTP date)."""
    c = checkpoint(request)
    if not await _files(request, c):
        raise UserError(f"checkpoint {c['tinker_path']!r} has no files on disk")
    route = "/".join(_q(p) for p in ("archives", c["run_id"], c["kind"], c["name"]))
    url, expires = signed_url(request, f"{route}/checkpoint.tar", archive_subject(c))
    raise web.HTTPFound(url, headers={"Expires": formatdate(expires, usegmt=True)})


def archive_subject(checkpoint: dict) -> str:
    """What an archive URL gives: this version of the checkpoint (as `file_subject`)."""
    return file_subject(checkpoint, "checkpoint.tar")


async def download_archive(request: web.Request) -> web.StreamResponse:
    """The tar of a checkpoint's files at a signed URL, built as it is sent."""
    c = _signed_checkpoint(request, archive_subject)
    directory = await _local(request, c)
    try:
        files = sorted(p.name for p in directory.iterdir()
                       if p.is_file() and not p.name.startswith("."))
    except OSError:  # signed, but gone (cannot happen short of a hand): the mark alone
        files = []
    response = web.StreamResponse(headers={
        "Content-Type": "application/x-tar",
        "Content-Disposition": f'attachment; filename="{c["name"]}.tar"'})
    await response.prepare(request)
    out = _QueueFile(asyncio.get_running_loop())
    writer = out.loop.run_in_executor(None, _write_tar, directory, files, out)
    sent = False
    try:
        while (chunk := await out.queue.get()) is not None:
            await response.write(chunk)
        sent = True
    finally:
        if not sent:  # the client went away: the writer stops at its next write
            out.stopped = True
            while await out.queue.get() is not None:
                pass
    await writer
    await response.write_eof()
    return response


class _QueueFile(io.RawIOBase):
    """A write-only file whose writes go, in order, to an asyncio queue (from a thread), a
    few at a time: the archive is never held whole."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue(maxsize=8)
        self.stopped = False

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if self.stopped:
            raise OSError("the download was stopped")
        self.put(bytes(b))
        return len(b)

    def put(self, item: bytes | None) -> None:
        asyncio.run_coroutine_threadsafe(self.queue.put(item), self.loop).result()


def _write_tar(directory: Path, files: list[str], out: _QueueFile) -> None:
    try:
        with tarfile.open(fileobj=out, mode="w|") as tar:
            for name in files:
                tar.add(Path(directory) / name, arcname=name)
            tar.addfile(tarfile.TarInfo(COMPLETE_MARK), io.BytesIO(b""))
    except OSError:
        if not out.stopped:
            raise
    finally:
        out.put(None)


# -- session traces --------------------------------------------------------------------

def trace_url(request: web.Request, session_id: str) -> str:
    return signed_url(request, f"sessions/{_q(session_id)}/trace.json",
                      f"trace\n{session_id}")[0]


async def download_trace(request: web.Request, build: Callable) -> web.Response:
    session_id = request.match_info["session_id"]
    check_signature(request, f"trace\n{session_id}")
    return web.json_response(build(request.app["store"], session_id), headers={
        "Content-Disposition": f'attachment; filename="{session_id}.json"'})


def add_download_routes(app: web.Application, checkpoint: Callable, build_trace: Callable,
                        ckpt_route: str) -> None:
    r = app.router
    r.add_get(f"{ckpt_route}/external_weights_urls", partial(external_weights_urls,
                                                             checkpoint=checkpoint))
    r.add_get(PREFIX + "checkpoints/{run_id}/{kind}/{name}/{file}", download_file)
    r.add_get(f"{ckpt_route}/archive", partial(archive_url, checkpoint=checkpoint))
    r.add_get(PREFIX + "archives/{run_id}/{kind}/{name}/checkpoint.tar", download_archive)
    r.add_get(PREFIX + "sessions/{session_id}/trace.json", partial(download_trace,
                                                                   build=build_trace))
