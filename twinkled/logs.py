"""Logging set-up: one line per event; `json` makes every line a JSON object for log
shippers, with the request fields (request_id, tenant, route, status, ms) as keys."""

from __future__ import annotations

import json
import logging
import time

REQUEST_FIELDS = ("request_id", "tenant", "route", "method", "status", "ms")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                + f".{int(record.msecs):03d}Z", "level": record.levelname,
                "logger": record.name, "message": record.getMessage()}
        body.update({k: getattr(record, k) for k in REQUEST_FIELDS if hasattr(record, k)})
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body)


def setup_logging(fmt: str = "text") -> None:
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, not {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    # aiohttp's access log repeats what our request line says; keep one line per request.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
