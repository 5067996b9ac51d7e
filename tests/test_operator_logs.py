"""JSON logs as a log shipper reads them: every line of the daemon's output (its workers'
too) is a JSON object, through a start, requests (a 4xx among them) and a stop. The lines
say what an operator looks for: where the data and the admin key are, the base URLs, each
run and checkpoint, a periodic summary, and why a request was refused; health checks are
not logged. The same daemon takes stray bytes on its workers' socket while it starts
(tests/daemon.py, send_stray_bytes_while_starting): they are ignored, and logged as JSON."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
from daemon import Daemon, make_key, send_stray_bytes_while_starting

tinker = pytest.importorskip("tinker")
T = 120


def test_json_mode_emits_only_json_lines(tiny_dir, tmp_path):
    key = make_key(tmp_path, "jo")
    cfg = tmp_path / "twinkled.toml"
    cfg.write_text("log_summary_s = 0.2\n")
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log", "--log-format", "json", "--config", str(cfg),
               wait=False)
    try:
        assert send_stray_bytes_while_starting(d), "the daemon opened no port beside its HTTP one"
        d.wait_ready()  # the stray bytes did not end the start
        tc = tinker.ServiceClient(base_url=d.url, api_key=key).create_lora_training_client(
            base_model=tiny_dir.name, rank=4).result(timeout=T)
        data = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
                                   loss_fn_inputs={"target_tokens": [6, 7, 8]})]
        tc.forward_backward(data, "cross_entropy").result(timeout=T)
        tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result(timeout=T)
        path = tc.save_state("first").result(timeout=T).path
        bad = httpx.post(f"{d.url}/api/v1/optim_step", headers={"X-API-Key": key},
                         json={"model_id": tc.model_id, "seq_id": "x"})
        assert 400 <= bad.status_code < 500
        assert d.health()["status"] == "ok"
        # The steps ran in well under a second: a summary (every 0.2 s, of an interval
        # with steps) may not have been written yet.
        deadline = time.time() + 10
        while '"summary"' not in d.log_path.read_text() and time.time() < deadline:
            time.sleep(0.05)
    finally:
        d.stop()
    lines = d.log_path.read_text().splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}")
    assert all(isinstance(r, dict) and r.get("message") is not None for r in records)
    events = {r.get("event") for r in records}
    assert {"run_created", "checkpoint_saved", "summary"} <= events
    assert any(r.get("checkpoint") == path for r in records)
    start = [r for r in records if "tinker_base_url" in r or "data_dir" in r]
    assert any(r.get("data_dir") == str(tmp_path) and r.get("admin_key_file") for r in start)
    assert any(r.get("tinker_base_url") == d.url and
               r.get("openai_base_url") == f"{d.url}/oai/api/v1" for r in start)
    http = [r for r in records if r.get("route")]
    assert http and not any(r["route"] == "/api/v1/healthz" for r in http)
    refused = [r for r in http if r["status"] == bad.status_code]
    assert refused and refused[0].get("reason"), refused
    assert records[-1]["message"] == "stopped"
    assert any("ignored a message of" in r["message"] for r in records)  # the stray bytes


def test_relay_makes_json_of_a_ranks_other_output(capsys):
    """What a rank writes outside logging (a C++ library, a crash, a progress bar's
    redraws) comes through the daemon as JSON lines; its JSON lines pass as they are."""
    from twinkled.protocol.logs import relay, setup_logging

    setup_logging("json")
    try:
        async def go():
            stream = asyncio.StreamReader()
            stream.feed_data(b'[Gloo] Rank 0 is connected\n{"level": "INFO", "message": "m"}\n'
                             b"Loading  0%\rLoading 100%\n")
            stream.feed_eof()
            await relay(stream, "twinkled.worker", rank=3)

        asyncio.run(go())
    finally:
        logging.getLogger().handlers.clear()
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
    assert [x["message"] for x in lines] == ["[Gloo] Rank 0 is connected", "m", "Loading  0%",
                                             "Loading 100%"]
    assert lines[0]["rank"] == 3 and lines[0]["logger"] == "twinkled.worker"
    assert lines[1] == {"level": "INFO", "message": "m"}


def test_summary_outlives_a_status_that_fails_at_first(caplog):
    """The periodic summary's first status reading may come while the daemon starts; one
    that raises must not end the task (it used to: no summary line ever after)."""
    from twinkled.server.summary import log_summaries

    readings = iter([RuntimeError("loading"), {"steps": 1, "tenants": {}},
                     {"steps": 3, "tenants": {"t": {"served_tokens": 64}}}])

    def status() -> dict:
        r = next(readings, None)
        if r is None:
            raise asyncio.CancelledError
        if isinstance(r, Exception):
            raise r
        return r

    with caplog.at_level(logging.INFO, logger="twinkled"), pytest.raises(asyncio.CancelledError):
        asyncio.run(log_summaries(status, 0.001))
    lines = [r for r in caplog.records if getattr(r, "event", None) == "summary"]
    assert len(lines) == 1 and lines[0].steps == 2 and lines[0].tenants_active == 1
