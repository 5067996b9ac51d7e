"""Logging set-up: one line per event; `json` makes every line a JSON object for log
shippers, with an event's fields (request_id, tenant, route, status, ms, reason, run_id,
...: whatever the call passed as `extra`) as keys. In JSON mode the worker ranks log JSON
too, and `relay` turns whatever else a rank writes (a C++ library's print, a crash's
traceback) into JSON lines, so that every line of the daemon's output parses."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time

# What a LogRecord holds of its own; anything else on a record came from `extra`.
_OWN = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
TEXT = "%(asctime)s %(name)s %(message)s"


class JsonFormatter(logging.Formatter):
    """`fields`: keys every line carries (a worker's rank)."""

    def __init__(self, **fields):
        super().__init__()
        self.fields = fields

    def format(self, record: logging.LogRecord) -> str:
        body = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                + f".{int(record.msecs):03d}Z", "level": record.levelname,
                "logger": record.name, "message": record.getMessage(), **self.fields}
        body.update({k: v for k, v in record.__dict__.items() if k not in _OWN})
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


def setup_logging(fmt: str = "text", text: str = TEXT, **fields) -> None:
    """Root logging for the daemon or a worker rank (`text`: its line format in text mode;
    `fields`: keys of its every JSON line)."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, not {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(**fields) if fmt == "json" else logging.Formatter(text))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # warnings.warn lines go through the same handler
    # aiohttp's access log repeats what our request line says; keep one line per request.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def route_transformers() -> None:
    """transformers logs through a handler of its own, in its own format: send its records
    to ours instead (a worker calls this once transformers is imported)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


async def relay(stream: asyncio.StreamReader, name: str, **fields) -> None:
    """Copy a child process's output to ours until it ends: a JSON line as it is, any
    other line as a log record of `name` (so it becomes JSON too). A progress bar's
    redraws (carriage returns) come out as separate records."""
    log = logging.getLogger(name)
    while True:
        try:
            line = await stream.readline()
        except ValueError:  # a line longer than the reader's limit: take what there is
            line = await stream.read(1 << 16)
        if not line:
            return
        text = line.decode(errors="replace").rstrip("\r\n")
        if text.startswith("{") and _is_json(text):
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
            continue
        for part in text.split("\r"):
            if part.strip():
                log.info("%s", part, extra=fields)


def _is_json(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
