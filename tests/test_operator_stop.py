"""A signal to the daemon's whole process group (Ctrl+C in a terminal, `timeout`, a shell
job kill, a container runtime) stops it as gracefully as a SIGTERM to the daemon alone:
the worker ranks live in a session of their own, so they are still there when shutdown
persists every live adapter, and the next start resumes each run at its step."""

from __future__ import annotations

import os
import signal
import time

import pytest
from daemon import Daemon, make_key

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
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log0", session=True)
    tc = tinker.ServiceClient(base_url=d.url, api_key=key).create_lora_training_client(
        base_model=tiny_dir.name, rank=4).result(timeout=T)
    ids = tc.get_tokenizer()("the sun and the sea are big.").input_ids
    data = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]})]
    try:
        for _ in range(2):
            tc.forward_backward(data, "cross_entropy").result(timeout=T)
            tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result(timeout=T)
        for i, sig in enumerate((signal.SIGINT, signal.SIGTERM), start=1):
            want = _logprobs(tc, data)  # a forward_backward changes no weights: still wanted
            sent = d.log_path.read_text().count(FB_LINE)
            queued = tc.forward_backward(data, "cross_entropy")  # the daemon has it when signalled
            deadline = time.time() + T
            while d.log_path.read_text().count(FB_LINE) <= sent:
                assert time.time() < deadline
                time.sleep(0.05)
            _stop_group(d, sig)
            d = Daemon(tiny_dir, tmp_path, tmp_path / f"log{i}", port=d.port, wait=False,
                       session=True)
            # The same client, on the same run: at the step it was told is done.
            while (d.health() or {}).get("status") != "loading":  # answering, not yet restored
                assert d.proc.poll() is None
                time.sleep(0.05)
            # Sent while the daemon loads: a 503 the client retries, served once the run is back.
            assert _logprobs(tc, data) == pytest.approx(want, rel=1e-5, abs=1e-6)
            assert queued.result(timeout=T).metrics["loss:sum"] > 0  # drained, not failed
            tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result(timeout=T)
            d.wait_ready()
    finally:
        d.stop()
