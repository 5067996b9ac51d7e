"""A signal to the daemon's whole process group (Ctrl+C in a terminal, `timeout`, a shell
job kill, a container runtime) stops it as gracefully as a SIGTERM to the daemon alone:
the worker ranks live in a session of their own, so they are still there when shutdown
persists every live adapter, and the next start resumes each run at its step. Each next
start also gets stray bytes on its workers' socket (from tests/test_join_port.py), and the
first daemon logs JSON (from tests/test_operator_logs.py: _json_log_says_what_an_operator_
looks_for)."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from daemon import Daemon, make_key, send_stray_bytes

tinker = pytest.importorskip("tinker")
T = 120
FB_LINE = "POST /api/v1/forward_backward 200"


def _logprobs(tc, data) -> list[float]:
    out = tc.forward(data, "cross_entropy").result(timeout=T)
    return [x for o in out.loss_fn_outputs for x in o["logprobs"].tolist()]


def _stop_group(d: Daemon, sig: int) -> None:
    """`sig` to `d`'s whole process group; it stops cleanly, leaving no worker behind."""
    workers = d.workers()
    assert len(workers) == 1
    os.killpg(d.proc.pid, sig)  # the daemon leads its group: every process in it
    assert d.proc.wait(timeout=60) == 0
    d.stop()
    for pid in workers:  # stopped by the daemon, not left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    log = d.log_path.read_text()
    assert "persisted 1 live adapter(s)" in log
    assert "WorkerLost" not in log and "Traceback" not in log and "KeyboardInterrupt" not in log


def test_a_signal_to_the_process_group_stops_cleanly(tiny_dir, tmp_path):
    """One lineage on one data dir: SIGINT to the first daemon's group, SIGTERM to the
    second's; each next start resumes the run where its client was told it is."""
    key = make_key(tmp_path, "gina")
    cfg = tmp_path / "twinkled.toml"
    cfg.write_text("log_summary_s = 0.2\n")
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log0", "--log-format", "json", "--config",
               str(cfg), session=True)
    tc = tinker.ServiceClient(base_url=d.url, api_key=key).create_lora_training_client(
        base_model=tiny_dir.name, rank=4).result(timeout=T)
    ids = tc.get_tokenizer()("the sun and the sea are big.").input_ids
    data = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]})]
    try:
        for _ in range(2):
            tc.forward_backward(data, "cross_entropy").result(timeout=T)
            tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result(timeout=T)
        path = tc.save_state("first").result(timeout=T).path
        bad = httpx.post(f"{d.url}/api/v1/optim_step", headers={"X-API-Key": key},
                         json={"model_id": tc.model_id, "seq_id": "x"})
        assert 400 <= bad.status_code < 500
        assert d.health()["status"] == "ok"
        for i, sig in enumerate((signal.SIGINT, signal.SIGTERM), start=1):
            want = _logprobs(tc, data)  # a forward_backward changes no weights: still wanted
            sent = d.log_path.read_text().count(FB_LINE)
            queued = tc.forward_backward(data, "cross_entropy")  # the daemon has it when signalled
            deadline = time.time() + T
            while d.log_path.read_text().count(FB_LINE) <= sent:
                assert time.time() < deadline
                time.sleep(0.05)
            _stop_group(d, sig)
            if i == 1:
                _json_log_says_what_an_operator_looks_for(d, path, bad.status_code)
            d = Daemon(tiny_dir, tmp_path, tmp_path / f"log{i}", port=d.port, wait=False,
                       session=True)
            # Stray bytes on its workers' socket while they start are ignored; before, the
            # start failed on them and the daemon served nothing.
            assert send_stray_bytes(d), "the daemon opened no port beside its HTTP one"
            # The same client, on the same run: at the step it was told is done.
            while (d.health() or {}).get("status") != "loading":  # answering, not yet restored
                assert d.proc.poll() is None
                time.sleep(0.05)
            # Sent while the daemon loads: a 503 the client retries, served once the run is back.
            assert _logprobs(tc, data) == pytest.approx(want, rel=1e-5, abs=1e-6)
            assert queued.result(timeout=T).metrics["loss:sum"] > 0  # drained, not failed
            tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result(timeout=T)
            d.wait_ready()
            assert "ignored a message of" in d.log_path.read_text()
    finally:
        d.stop()


def _json_log_says_what_an_operator_looks_for(d: Daemon, checkpoint: str, refused: int) -> None:
    """JSON logs as a log shipper reads them: every line of the daemon's output (its
    workers' too) is a JSON object, through a start, requests (a 4xx among them) and a
    stop. The lines say what an operator looks for: where the data and the admin key are,
    the base URLs, each run and checkpoint, a periodic summary, and why a request was
    refused; health checks are not logged."""
    records = []
    for line in d.log_path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}")
    assert all(isinstance(r, dict) and r.get("message") is not None for r in records)
    events = {r.get("event") for r in records}
    assert {"run_created", "checkpoint_saved", "summary"} <= events
    assert any(r.get("checkpoint") == checkpoint for r in records)
    start = [r for r in records if "tinker_base_url" in r or "data_dir" in r]
    assert any(r.get("data_dir") == str(d.data_dir) and r.get("admin_key_file") for r in start)
    assert any(r.get("tinker_base_url") == d.url and
               r.get("openai_base_url") == f"{d.url}/oai/api/v1" for r in start)
    http = [r for r in records if r.get("route")]
    assert http and not any(r["route"] == "/api/v1/healthz" for r in http)
    refused_lines = [r for r in http if r["status"] == refused]
    assert refused_lines and refused_lines[0].get("reason"), refused_lines
    assert records[-1]["message"] == "stopped"
