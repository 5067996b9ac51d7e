"""A long-context tenant on a lane of its own (issue 38; twinkled/core/long_rows.py), through
the unmodified tinker client against a real `twinkled serve` of two CPU lanes: once a run
sends a row over `long_row_tokens`, the short runs that shared its lane move to the other
one when idle (training on where they left off: the same losses as a run never moved), new
runs go there too, and no step of a short tenant ever holds the long row. The rules one by
one, without a daemon: tests/test_long_lane_rules.py."""

from __future__ import annotations

import json
import os
import time

import pytest
from daemon import Daemon, ctl_status, make_key, run_ctl
from helpers import TINKER_T, lora_client, tinker_datums

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

LONG_ROW = 24  # long_row_tokens: the short rows below are under it, the long row over it
SHORT = ["the sun and the sea are big.", "a cat sat on the mat today"]


def _wait(d: Daemon, test, what: str, timeout: float = 60) -> dict:
    """`ctl status` once `test` holds of it (the balancer runs every 2 s)."""
    deadline = time.monotonic() + timeout
    while True:
        status = ctl_status(d.data_dir)
        if test(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}; status: lanes {status.get('lanes')}, "
                                 f"long runs {status.get('long_runs')}")
        time.sleep(0.2)


def _adapters(status: dict) -> list[int]:
    return [lane["adapters"] for lane in status["lanes"]]


def test_short_runs_leave_the_long_runs_lane_and_train_on(tiny_dir, tmp_path):
    cfg = tmp_path / "twinkled.toml"
    cfg.write_text(f"long_row_tokens = {LONG_ROW}\n")
    trace = tmp_path / "trace.jsonl"
    keys = {t: make_key(tmp_path, t) for t in ("lena", "sam")}
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log", "--workers", "2", "--lanes", "2",
               "--config", str(cfg), env={"TWINKLED_TRACE": str(trace)})
    d.keys = keys
    try:
        lena = lora_client(d, "lena", tiny_dir, 1)  # lane 0 (the fewest models)
        stays = lora_client(d, "sam", tiny_dir, 7)  # lane 1
        mover = lora_client(d, "sam", tiny_dir, 7)  # lane 0, beside lena's (the same seed)
        tok = lena.get_tokenizer()
        short = tinker_datums(tok, SHORT)
        long = tinker_datums(tok, [" ".join(SHORT * 3)])
        assert max(len(x.model_input.to_ints()) for x in short) <= LONG_ROW \
            < len(long[0].model_input.to_ints())
        adam = tinker.types.AdamParams(learning_rate=1e-2)
        losses: dict[str, list[float]] = {"moved": [], "kept": []}

        def steps(clients: dict) -> None:
            """A forward_backward + optim_step of each client, all submitted at once."""
            futures = {name: (tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam))
                       for name, (tc, data) in clients.items()}
            for name, (fb, opt) in futures.items():
                out = fb.result(timeout=TINKER_T)
                opt.result(timeout=TINKER_T)
                if name in losses:
                    losses[name].append(out.metrics["loss:sum"])

        steps({"moved": (mover, short), "kept": (stays, short)})
        assert _adapters(ctl_status(d.data_dir)) == [2, 1]
        steps({"lena": (lena, long)})  # lena's run is long now: lane 0 is a long lane
        status = _wait(d, lambda s: _adapters(s) == [1, 2],
                       "the idle short run did not leave the long run's lane")
        assert [lane["long"] for lane in status["lanes"]] == [True, False]
        assert [(r["lane"], r["tenant"]) for r in status["long_runs"]] == [(0, "lena")]
        assert status["lane_moves"] == 1
        text = run_ctl(d.data_dir, "status").stdout
        assert "long lane" in text
        # each lane's host tier, with its budget (nothing parked there yet)
        assert text.count("0 parked in host memory (0 B of ") == 2, text
        late = lora_client(d, "sam", tiny_dir, 9)  # a new run: the lane with no long run
        assert _adapters(ctl_status(d.data_dir)) == [1, 3]
        for _ in range(2):  # side by side: lena's long rows, the short runs on their lane
            steps({"lena": (lena, long), "moved": (mover, short), "kept": (stays, short),
                   "late": (late, short)})
    finally:
        d.stop()
    # The moved run trained on where it left off: its losses are the unmoved twin's.
    assert len(losses["moved"]) == 3
    for a, b in zip(losses["moved"], losses["kept"], strict=True):
        assert abs(a - b) < 1e-4 * max(1.0, abs(b)), losses
    # No step held both the long row and a short tenant's work.
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    with_long = [e for e in events if e["event"] == "loop" and any(
        tokens > LONG_ROW for _, tokens in e.get("tenants", {}).get("lena", []))]
    assert len(with_long) >= 3 and all(set(e["tenants"]) == {"lena"} for e in with_long)
