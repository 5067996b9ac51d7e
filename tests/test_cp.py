"""Context parallelism on the CPU (issue 38): a group of two gloo ranks at cp=2 gives the
same logprobs, losses and LoRA gradients as one rank, for rows longer than a chunk
co-batched with another tenant's short rows (fp32, 1e-4).

The group runs tests/cp_scenario.py in two processes: tenant a's long rows (cross-entropy;
gspo, whose sequence ratio couples a row's tokens) and the base model's long forward-only
row on both ranks, split by tokens; tenant b's short rows divided between them. This
process runs the scenario on one whole engine and compares."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from cp_scenario import SHORT, requests, results, setup
from daemon import free_port
from helpers import rel_diff

from twinkled.engine.context_parallel import ContextParallel
from twinkled.engine.engine import Engine

HERE = Path(__file__).parent
RTOL = 1e-4


def _group(model_dir, out: Path, **extra) -> list[dict]:
    """Run tests/cp_scenario.py on two ranks; their results, rank by rank."""
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(HERE / "cp_scenario.py"), json.dumps(
        {"url": url, "rank": r, "world": 2, "model": str(model_dir), "out": str(out),
         **extra})]) for r in range(2)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0]
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def cp_run(tiny_dir, tmp_path_factory):
    """The group's results; a token budget that puts each long row in a micro-batch of
    its own (several split micro-batches, each with its collectives)."""
    return _group(tiny_dir, tmp_path_factory.mktemp("cp"), token_budget=80)


def test_cp2_matches_one_rank(tiny_dir, cp_run):
    _compare(cp_run, Engine(tiny_dir), RTOL)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs (NCCL)")
def test_cp2_on_two_gpus_matches_one(tiny_dir, tmp_path):
    """The GPU path: flash's varlen kernel over the gathered keys, NCCL, bf16 (so a bf16
    tolerance: a wrong layout is off by far more)."""
    got = _group(tiny_dir, tmp_path, token_budget=80, device="cuda", dtype="bfloat16")
    _compare(got, Engine(tiny_dir, device="cuda:0", dtype="bfloat16"), 5e-2)


def _compare(group: list[dict], engine: Engine, rtol: float) -> None:
    """The group's results against one whole engine's on the same scenario."""
    setup(engine)
    reqs = requests(engine.model.vocab_size)
    want = results(engine, reqs, engine.forward_backward(reqs))
    for rank, got in enumerate(group):
        # The long rows, whole on every rank of the group (rank 0's are reported).
        for i in (0, 2, 3):
            for kind in ("logprobs", "loss"):
                for g, w in zip(got[kind][i], want[kind][i], strict=True):
                    assert g.shape == w.shape and rel_diff(g, w) < rtol, (rank, i, kind)
        # Tenant b's short rows, each on the rank that ran it.
        for k, j in enumerate(SHORT[rank]):
            assert rel_diff(got["logprobs"][1][k], want["logprobs"][1][j]) < rtol
            assert rel_diff(got["loss"][1][k], want["loss"][1][j]) < rtol
        # LoRA gradients, summed over the group as the optimizer step sums them.
        for name in ("grads_a", "grads_b"):
            assert want[name].keys() == got[name].keys()
            for key, w in want[name].items():
                assert w.abs().max() > 0, key  # the scenario reaches every parameter
                assert rel_diff(got[name][key], w) < rtol, (rank, name, key)
        assert got["pending"] == want["pending"] == [3, 3]  # a split row counts once


def test_cp2_step_runner_reports_each_row_once(tiny_dir, cp_run):
    """The worker's StepRunner at cp=2 picks its rows (long ones on both ranks, short ones
    split), and the executor's merge of the two ranks' outcomes gives every datum once,
    equal to one rank's result, with its loss:sum."""
    from cp_scenario import frames

    from twinkled.core.replies import merge_replies
    from twinkled.protocol.frames import OutcomeF, ReplyF

    engine = Engine(tiny_dir)
    setup(engine)
    reqs = requests(engine.model.vocab_size)
    want = engine.forward_backward(reqs)
    replies = [ReplyF(1, r, msgspec.msgpack.decode(got["outcomes"], type=list[OutcomeF]))
               for r, got in enumerate(cp_run)]
    merged = merge_replies(frames(reqs), replies)
    for (result, error, _), w in zip(merged, want, strict=True):
        assert error is None
        assert len(result.outputs) == len(w.outputs)
        for g, o in zip(result.outputs, w.outputs, strict=True):
            assert rel_diff(g["logprobs"].values(), o["logprobs"].tolist()) < RTOL
        assert result.metrics["loss:sum"] == pytest.approx(w.metrics["loss:sum"], rel=RTOL)


def test_chunks_balance_causal_work():
    cp = ContextParallel.__new__(ContextParallel)
    cp.size, cp.min_tokens, cp.rank, cp.group = 2, 32, 0, None
    assert cp.chunks(10) == [(0, 2), (2, 5), (5, 8), (8, 10)]  # 2N chunks, all tokens
    assert [cp.held(r) for r in range(2)] == [(0, 3), (1, 2)]
    assert not cp.splits(32) and cp.splits(33)
