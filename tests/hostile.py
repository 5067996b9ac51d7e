"""Helpers for the hostile-tenant tests (test_isolation.py, test_fuzz.py).

- `Box`: a real `twinkled serve` that a test may see die (or that the memory watchdog kills)
  and that is brought back on the same port and data dir, so later tests still run.
- `Watchdog`: keeps a runaway allocation in the daemon or a worker from taking the test
  machine down (the issue's triggers include a 23 GB one): a worker over its limit is killed
  (as the kernel's OOM killer would), the daemon over its limit is killed with its workers;
  each trip is reported by the test that caused it.
- `/metrics` scraping: the worker restart counter, and every 5xx the daemon answered.
- `Raw`: Tinker calls over plain HTTP (JSON, protobuf), every one with a timeout.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import struct
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import httpx
from daemon import Daemon, make_key

T = 60  # seconds for an answer that should come (a step on the tiny model takes ms)
NEXT_T = 20  # the bad tenant's next request: it must not hang; it should take well under 1 s
DAEMON_MAX_MB = 3000  # the HTTP process: it holds no tensors
WORKER_MAX_MB = 5000  # a CPU worker with the tiny model needs well under 1 GB


def rss_mb(pid: int) -> float:
    """VmRSS of a process in MB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return 0.0


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Watchdog(threading.Thread):
    """Kills a worker (or the daemon) whose RSS passes its limit, and says so in `trips`."""

    def __init__(self, daemon: Daemon, trips: list[str]):
        super().__init__(daemon=True, name="rss-watchdog")
        self.d, self.trips, self.stop = daemon, trips, threading.Event()
        self.peak_daemon_mb = 0.0

    def run(self) -> None:
        pid = self.d.proc.pid
        workers, asked = [], 0.0
        while not self.stop.wait(0.05) and self.d.proc.poll() is None:
            if time.monotonic() - asked > 0.5:  # (the daemon's account of its workers)
                workers, asked = self.d.workers() or workers, time.monotonic()
            mb = rss_mb(pid)
            self.peak_daemon_mb = max(self.peak_daemon_mb, mb)
            if mb > DAEMON_MAX_MB:
                _kill(pid)
                for w in workers:
                    _kill(w)
                self.trips.append(f"the daemon's RSS reached {mb:.0f} MB (limit "
                                  f"{DAEMON_MAX_MB}): the test's watchdog killed it")
                return
            for w in workers:
                wmb = rss_mb(w)
                if wmb > WORKER_MAX_MB:
                    _kill(w)
                    self.trips.append(f"worker {w}'s RSS reached {wmb:.0f} MB (limit "
                                      f"{WORKER_MAX_MB}): the test's watchdog killed it")


class Box:
    """A module's daemon, with API keys for `tenants`, brought back if it dies."""

    def __init__(self, model_dir: Path, data_dir: Path, config: str, tenants, env=None,
                 workers: int = 1):
        self.model_dir, self.data_dir, self.env, self.n_workers = model_dir, data_dir, env, workers
        self.cfg = data_dir / "twinkled.toml"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.cfg.write_text(config)
        self.keys = {t: make_key(data_dir, t) for t in tenants}
        self.trips: list[str] = []  # watchdog kills not yet reported by a test
        self.generation = 0  # daemon starts; more than one means it died and was restarted
        self.port: int | None = None
        self.d: Daemon | None = None
        self._start()

    def _start(self) -> None:
        self.generation += 1
        log = self.data_dir / f"twinkled.{self.generation}.log"
        self.d = Daemon(self.model_dir, self.data_dir, log, "--config", str(self.cfg),
                        "--workers", str(self.n_workers), port=self.port, env=self.env)
        self.port = self.d.port
        self.watchdog = Watchdog(self.d, self.trips)
        self.watchdog.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.d.proc.pid

    def alive(self) -> bool:
        return self.d.proc.poll() is None

    def ensure_up(self, timeout: float = 120) -> None:
        """The daemon runs, is healthy, and its workers are up (restarting it if it died)."""
        if not self.alive():
            self.d.log.close()
            self._start()
        self.d.wait_workers(self.n_workers, timeout=timeout)

    def wait_healthy(self, timeout: float = 120) -> str | None:
        """Wait for the workers (after a crash they restart); a problem string, or None."""
        if not self.alive():
            return f"the daemon is dead (exit code {self.d.proc.returncode})"
        try:
            self.d.wait_workers(self.n_workers, timeout=timeout)
        except TimeoutError as e:
            return f"the daemon did not become healthy again in {timeout:.0f} s: {e}"
        return None

    def take_trips(self) -> list[str]:
        out, self.trips[:] = list(self.trips), []
        return out

    def stop(self) -> None:
        self.watchdog.stop.set()
        self.d.stop()

    # -- /metrics ----------------------------------------------------------------------

    def metrics_text(self) -> str | None:
        # urllib, not httpx.get: each httpx.get builds a client and with it an SSL context
        # (~30 ms of CPU loading the CA bundle, for a plain-HTTP URL), and every hostile
        # test scrapes /metrics four times (Watch): 7 s of test_isolation's CPU went there.
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
                return r.read().decode() if r.status == 200 else None
        except (OSError, http.client.HTTPException):  # (an HTTPError is an OSError)
            return None

    def restarts(self) -> float | None:
        """twinkle_worker_restarts_total (None: /metrics does not answer)."""
        text = self.metrics_text()
        if text is None:
            return None
        m = re.search(r"^twinkle_worker_restarts_total\s+(\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def server_errors(self) -> dict[tuple[str, str], float]:
        """{(route, status): count} of every 5xx the daemon has answered."""
        text = self.metrics_text() or ""
        out = {}
        for m in re.finditer(r'^twinkle_requests_total\{(.*?)\}\s+(\S+)$', text, re.M):
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(1)))
            if labels.get("status", "").startswith("5"):
                out[(labels.get("route", "?"), labels["status"])] = float(m.group(2))
        return out


def new_5xx(before: dict, after: dict) -> list[str]:
    grown = {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
    return [f"{route} answered {status} x{n:g}" for (route, status), n in sorted(grown.items())]


class Watch:
    """What a test must leave unchanged: worker restarts, daemon life, 5xx answers."""

    def __init__(self, box: Box):
        self.box = box
        self.generation = box.generation
        self.restarts = box.restarts()
        self.errors = box.server_errors()

    def problems(self) -> list[str]:
        box, out = self.box, []
        out += box.take_trips()
        if box.generation != self.generation or not box.alive():
            out.append(f"the daemon died during the test (exit code {box.d.proc.returncode})")
            return out
        now = box.restarts()
        if now != self.restarts:
            out.append(f"twinkle_worker_restarts_total moved: {self.restarts} -> {now}")
        out += [f"5xx during the test: {e}" for e in new_5xx(self.errors, box.server_errors())]
        return out


class Checks:
    """Collects every problem of a test, so that one failure message says them all."""

    def __init__(self):
        self.problems: list[str] = []

    def check(self, what: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - every failure becomes one line of the report
            # pytest's assertion rewriting appends "assert ..." lines: the message is enough
            text = str(e).split("\nassert ")[0].strip().replace("\n", " ")
            self.problems.append(f"{what}: {type(e).__name__}: {text[:600]}")
            return None

    def add(self, *problems: str) -> None:
        self.problems += [p for p in problems if p]

    def done(self) -> None:
        assert not self.problems, "\n  - " + "\n  - ".join(self.problems)


# -- raw HTTP ------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int | None  # None: no HTTP answer (timeout, connection closed)
    text: str = ""
    content: bytes = b""
    content_type: str = ""
    error: str = ""  # what went wrong when there was no answer

    @property
    def json(self):
        try:
            import json

            return json.loads(self.text)
        except ValueError:
            return None

    def describe(self, n: int = 300) -> str:
        if self.status is None:
            return f"no answer ({self.error})"
        return f"HTTP {self.status} {self.text[:n]!r}"


def is_clean_4xx(status: int | None) -> bool:
    """A refusal the tinker client does not retry: 400..429 except 408 and 409."""
    return status is not None and 400 <= status <= 429 and status not in (408, 409)


class Raw:
    """Plain HTTP to /api/v1 as one tenant; every call has a timeout and returns an Answer."""

    def __init__(self, url: str, key: str, timeout: float = 30):
        self.c = httpx.Client(base_url=f"{url}/api/v1", timeout=timeout,
                              headers={"X-API-Key": key})
        self.model_seq = 0  # create_model's model_seq_id within self.sid
        self.sampler_seq = 0
        self.sid: str | None = None

    def close(self) -> None:
        self.c.close()

    def send(self, method: str, path: str, timeout: float | None = None, **kw) -> Answer:
        try:
            r = self.c.request(method, path, timeout=timeout or self.c.timeout, **kw)
        except httpx.HTTPError as e:
            return Answer(None, error=f"{type(e).__name__}: {e}"[:300])
        return Answer(r.status_code, r.text if _texty(r) else "", r.content,
                      r.headers.get("content-type", ""))

    def post(self, path: str, json=None, **kw) -> Answer:
        return self.send("POST", path, json=json, **kw)

    def get(self, path: str, **kw) -> Answer:
        return self.send("GET", path, **kw)

    def poll(self, request_id: str, timeout: float = T) -> Answer:
        """The future's final answer; status None with an error if none came in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            a = self.post("/retrieve_future", {"request_id": request_id,
                                               "allow_metadata_only": False})
            if a.status == 200 and a.content_type.startswith("application/json") and \
                    (a.json or {}).get("type") == "try_again":
                continue
            return a
        return Answer(None, error=f"the future was still pending after {timeout:.0f} s")

    def result(self, submitted: Answer, what: str, timeout: float = T) -> Answer:
        """Submit answer -> the future's successful answer; AssertionError otherwise."""
        assert submitted.status == 200, f"{what}: {submitted.describe()}"
        a = self.poll(submitted.json["request_id"], timeout)
        assert a.status == 200, f"{what}: {a.describe()}"
        body = a.json if a.content_type.startswith("application/json") else None
        assert not (body and "error" in body), f"{what} failed: {a.text[:300]}"
        return a

    # -- objects -------------------------------------------------------------------------

    def session(self) -> str:
        a = self.post("/create_session", {"tags": [], "user_metadata": {},
                                          "sdk_version": "0.38.0", "type": "create_session"})
        assert a.status == 200, f"create_session: {a.describe()}"
        self.sid = a.json["session_id"]
        self.model_seq = self.sampler_seq = 0
        return self.sid

    def create_model_body(self, rank: int = 4, **extra) -> dict:
        body = {"session_id": self.sid, "model_seq_id": self.model_seq,
                "base_model": self.base_model, "lora_config": {"rank": rank},
                "type": "create_model"}
        self.model_seq += 1
        body.update(extra)
        return body

    def model(self, rank: int = 4, timeout: float = T, **extra) -> str:
        a = self.post("/create_model", self.create_model_body(rank, **extra))
        return self.result(a, "create_model", timeout).json["model_id"]

    def sampler(self) -> str:
        a = self.post("/create_sampling_session", {
            "session_id": self.sid, "sampling_session_seq_id": self.sampler_seq,
            "base_model": self.base_model, "type": "create_sampling_session"})
        self.sampler_seq += 1
        assert a.status == 200, f"create_sampling_session: {a.describe()}"
        return a.json["sampling_session_id"]

    base_model = ""  # set by the test module (the tiny model dir's name)

    # -- requests ------------------------------------------------------------------------

    def fwdbwd(self, model_id: str, seq_id: int, tokens=(5, 6, 7, 8), **kw) -> Answer:
        return self.post("/forward_backward", content=fwdbwd_proto(model_id, seq_id, tokens, **kw),
                         headers={"Content-Type": "application/x-protobuf"})

    def optim(self, model_id: str, seq_id: int, lr: float = 1e-3) -> Answer:
        return self.post("/optim_step", {"model_id": model_id, "seq_id": seq_id,
                                         "adam_params": {"learning_rate": lr},
                                         "type": "optim_step"})

    def round(self, model_id: str, seq_id: int, timeout: float = NEXT_T) -> None:
        """A valid forward_backward (seq_id) and optim_step (seq_id + 1), both completed."""
        fb = self.fwdbwd(model_id, seq_id)
        opt = self.optim(model_id, seq_id + 1)
        self.result(fb, f"forward_backward seq_id {seq_id}", timeout)
        self.result(opt, f"optim_step seq_id {seq_id + 1}", timeout)

    def sample_body(self, sampler_id: str, tokens=(5, 6, 7), **params) -> dict:
        sp = {"max_tokens": 2, "temperature": 1.0}
        sp.update(params)
        return {"sampling_session_id": sampler_id, "seq_id": 0, "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(tokens)}]},
                "sampling_params": sp, "type": "sample"}

    def sample(self, sampler_id: str, timeout: float = NEXT_T, **params) -> Answer:
        a = self.post("/asample", self.sample_body(sampler_id, **params))
        return self.result(a, "asample", timeout)


def _texty(r: httpx.Response) -> bool:
    ct = r.headers.get("content-type", "")
    return not ct.startswith("application/x-protobuf")


def pb():
    import tinker.proto.tinker_public_pb2 as m

    return m


def fwdbwd_proto(model_id: str, seq_id: int, tokens=(5, 6, 7, 8), targets=None,
                 loss_fn: str = "cross_entropy", forward_only: bool = False) -> bytes:
    """A ForwardBackwardRequest of one datum, built with the tinker wheel's own classes."""
    m = pb()
    tokens = list(tokens)
    targets = list(targets) if targets is not None else [t + 1 for t in tokens]
    req = m.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn,
                                   forward_only=forward_only)
    d = req.data.add()
    d.model_input.add().encoded_text.tokens = struct.pack(f"<{len(tokens)}i", *tokens)
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype, t.dense = m.DTYPE_INT64, struct.pack(f"<{len(targets)}q", *targets)
    t.shape.append(len(targets))
    return req.SerializeToString()


def sample_tokens(content: bytes) -> list[list[int]]:
    """The token lists of a SampleResponse protobuf."""
    out = pb().SampleResponse.FromString(content)
    return [list(struct.unpack(f"<{len(s.tokens) // 4}i", s.tokens)) for s in out.sequences]
