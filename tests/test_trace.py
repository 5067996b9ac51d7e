"""The step trace (TWINKLED_TRACE, twinkled/protocol/trace.py) that the host-path profile is read from:
a daemon with two worker ranks, driven by the real tinker client, writes per step the loop's
phases and each rank's timings, and bench/trace_report.py tabulates them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemon import Daemon, make_key

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

T = 120
REPORT = Path(__file__).resolve().parents[1] / "bench" / "trace_report.py"


def test_a_traced_daemon_records_each_ranks_share_of_a_step(tiny_dir, tmp_path):
    path = tmp_path / "trace.jsonl"
    d = Daemon(tiny_dir, tmp_path / "data", tmp_path / "log", "--workers", "2",
               env={"TWINKLED_TRACE": str(path)})
    try:
        sc = tinker.ServiceClient(base_url=d.url, api_key=make_key(d.data_dir, "t"))
        tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=T)
        ids = list(range(5, 37))
        datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                                   loss_fn_inputs={"target_tokens": ids[1:]})
        for _ in range(2):
            tc.forward_backward([datum, datum], "cross_entropy").result(timeout=T)
            tc.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result(timeout=T)
    finally:
        d.stop()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    loops = [e for e in events if e["event"] == "loop"]
    groups = [e for e in events if e["event"] == "group"]
    assert {"train", "barrier"} <= {e["kind"] for e in loops}
    for e in loops:  # the loop's phases, in order
        assert e["planned"] <= e["executing"] <= e["completing"] <= e["done"]
    train = [g for g in groups if g["kind"] == "train"]
    assert train and all(len(g["ranks"]) == 2 for g in groups)
    for g in train:
        for r in g["ranks"]:  # each rank's stamps line up with the daemon's clock
            assert g["sent"] <= r["began"] <= r["began"] + r["busy"] <= r["arrived"]
    # Each of the two rows ran on its own rank: both issued a forward and a backward.
    assert any(all(r["phases"]["forward"] > 0 and r["phases"]["backward"] > 0
                   for r in g["ranks"]) for g in train)
    out = subprocess.run([sys.executable, str(REPORT), str(path)], capture_output=True,
                         text=True, check=True).stdout
    assert "rank 1 busy" in out and "step (train: fwdbwd" in out
