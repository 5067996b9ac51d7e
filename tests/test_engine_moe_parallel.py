"""Expert parallelism (engine/moe_parallel.py) on two gloo CPU ranks against one rank."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from daemon import free_port
from helpers import ce_request, randomize_b, weights

from twinkled.engine.engine import Engine
from twinkled.engine.types import AdamParams, LoraConfig, SampleRequest, SamplingParams


def _script(eng: Engine) -> dict:
    """Two adapters trained two steps, then their logprobs, weights and greedy samples."""
    eng.add_adapter("a", LoraConfig(rank=4, seed=1))
    eng.add_adapter("b", LoraConfig(rank=8, seed=2))
    randomize_b(eng, "b", seed=3, std=0.1)
    gen = torch.Generator().manual_seed(0)
    reqs = [ce_request("a", gen, 1024, [9, 6]), ce_request("b", gen, 1024, [11])]
    losses = []
    for _ in range(2):
        losses += [r.metrics["loss:sum"] for r in eng.forward_backward(reqs)]
        eng.optim_steps([("a", AdamParams(learning_rate=1e-2)),
                         ("b", AdamParams(learning_rate=1e-2))])
    logprobs = [r.outputs[0]["logprobs"] for r in eng.forward(reqs)]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, stop=[])
    samples = [r.sequences[0] for r in eng.sample(
        [SampleRequest(n, [5, 9, 33], greedy) for n in ("a", "b")])]
    return {"losses": losses, "logprobs": logprobs, "weights": weights(eng, "a"),
            "tokens": [s.tokens for s in samples], "sample_lp": [s.logprobs for s in samples]}


def _rank(rank: int, world: int, port: int, model_dir, out):
    import torch.distributed as dist

    from twinkled.engine.moe_parallel import expert_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    split, dp = expert_groups(rank, world, world)
    eng = Engine(model_dir, experts=split, dp_group=dp)
    assert eng.model.moe[0].gate_up.shape[0] == 8 // world  # only this rank's experts
    out[rank] = _script(eng)
    dist.destroy_process_group()


def test_two_expert_parallel_ranks_match_one_rank(moe_dir):
    want = _script(Engine(moe_dir))
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_rank, args=(2, free_port(), moe_dir, out), nprocs=2)
        got = dict(out)
    for rank in (0, 1):
        g = got[rank]
        assert g["tokens"] == want["tokens"]
        assert g["losses"] == pytest.approx(want["losses"], rel=1e-5)
        for x, y in zip(g["logprobs"], want["logprobs"], strict=True):
            assert torch.allclose(x, y, atol=1e-5)
        for x, y in zip(g["sample_lp"], want["sample_lp"], strict=True):
            assert x == pytest.approx(y, abs=1e-5)
        worst = max((g["weights"][k][i] - want["weights"][k][i]).abs().max().item()
                    for k in want["weights"] for i in range(2))
        assert worst <= 1e-5, worst


def test_ep_must_divide_the_experts(moe_dir):
    from twinkled.engine.moe_parallel import ExpertSplit
    from twinkled.engine.types import EngineInputError

    with pytest.raises(EngineInputError, match="ep=3 does not divide the 8 experts"):
        Engine(moe_dir, experts=ExpertSplit(0, 3, None))
