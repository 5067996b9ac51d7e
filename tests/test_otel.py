"""OpenTelemetry traces of requests (twinkled/core/otel.py, server/otel.py): the real
`tinker` client trains one step through the daemon's app (served in this process, on an
in-process worker group), and the spans go to the SDK's in-memory exporter. Skipped where
the `otel` extra is not installed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

pytest.importorskip("opentelemetry.sdk")
tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from twinkled.core import otel  # noqa: E402

T = 120
# aiohttp advises typed app keys; the app (not this test) uses string keys
pytestmark = pytest.mark.filterwarnings("ignore:It is recommended to use web")


def train_one_step(url: str, key: str, base_model: str) -> None:
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model=base_model, rank=4).result(timeout=T)
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7, 8]),
                               loss_fn_inputs={"target_tokens": [6, 7, 8, 9],
                                               "weights": [1.0] * 4})
    tc.forward_backward([datum], "cross_entropy").result(timeout=T)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=T)
    sampler.sample(tinker.types.ModelInput.from_ints([5, 6]), 1,
                   tinker.types.SamplingParams(max_tokens=2)).result(timeout=T)


async def serve_and_train(tiny_dir, data_dir) -> None:
    from aiohttp.test_utils import TestServer

    from twinkled.core.make_executor import in_process_executor
    from twinkled.core.service import Service
    from twinkled.protocol.config import Config
    from twinkled.server.app import make_app
    from twinkled.store import Store

    cfg = Config(model=tiny_dir, data_dir=data_dir, device="cpu", dtype="float32",
                 gather_ms=0, worker_threads=1)
    store = Store(data_dir / "twinkled.store.db")
    key = store.tenants.create_key(store.tenants.ensure("alice")["name"])
    svc = Service(cfg, store, executor=[in_process_executor(cfg)])
    server = TestServer(make_app(svc, store, "admin"), host="127.0.0.1")
    await server.start_server()
    try:
        await asyncio.wait_for(svc.life.settled(), T)
        await asyncio.to_thread(train_one_step, str(server.make_url("")).rstrip("/"), key,
                                tiny_dir.name)
    finally:
        await server.close()
        store.close()


def test_a_requests_spans_from_the_door_to_the_reply(tiny_dir, tmp_path):
    exporter = InMemorySpanExporter()
    otel.setup(exporter)
    try:
        asyncio.run(asyncio.wait_for(serve_and_train(tiny_dir, tmp_path), 300))
    finally:
        otel.shutdown()
    spans = exporter.get_finished_spans()
    [request] = [s for s in spans if s.name == "POST /api/v1/forward_backward"]
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["twinkle.tenant"] == "alice"
    children = {s.name: s for s in spans if s.parent is not None
                and s.parent.span_id == request.context.span_id}
    assert set(children) == {"door check", "queued", "step", "reply"}
    door, queued, step, reply = (children[n] for n in ("door check", "queued", "step", "reply"))
    assert {s.context.trace_id for s in children.values()} == {request.context.trace_id}
    # one after another: the door, the queue, the step that ran it, the reply
    assert request.start_time == door.start_time
    assert door.end_time == queued.start_time <= queued.end_time == step.start_time
    assert step.end_time == reply.start_time <= reply.end_time
    assert step.attributes["twinkle.step.kind"] == "train"
    assert step.attributes["twinkle.step.tenants"] == ("alice",)
    assert step.attributes["twinkle.step.tokens"] == 4 and step.attributes["twinkle.step"] >= 1
    assert reply.attributes["twinkle.op"] == "forward_backward"
    # another request, another trace; a sample (decoded in slices across steps) is one
    # span from queued to settled
    [asample] = [s for s in spans if s.name == "POST /api/v1/asample"]
    assert asample.context.trace_id != request.context.trace_id
    under = {s.name for s in spans if s.parent and s.parent.span_id == asample.context.span_id}
    assert under == {"door check", "sample"}


def test_off_by_default_and_nothing_imported(monkeypatch):
    """No config key, no OTEL_ variable: no middleware, and the SDK is never imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    code = ("import sys; from twinkled.server.app import make_app; from twinkled.core import otel;"
            "from twinkled.server.otel import traced; app = make_app(None, None);"
            "assert traced not in app.middlewares and not otel.enabled();"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert not otel.wanted(False) and otel.wanted(True)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    assert otel.wanted(False)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not otel.wanted(True)
