"""One training-and-sampling scenario, run alike by a whole engine (tp=1, in the test
process) and by each rank of a tensor-parallel group (`python tests/tp_scenario.py`), so
tests/test_engine_tp.py can compare what they give. Rank 0 of the group writes its results
with torch.save."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from twinkled.protocol.types import (
    AdamParams,
    Datum,
    DimuonParams,
    ForwardBackwardRequest,
    LoraConfig,
    SampleRequest,
    SamplingParams,
)
from twinkled.workers.parked import HostTier


def _whole(engine, adapter_id: str, kind: str) -> dict[str, torch.Tensor]:
    """The adapter's weights ("w") or gradients ("g"), whole whatever the split."""
    a = engine.pool.get(adapter_id)
    keys = list(a.bank.shapes)
    views = a.bank.tensors(a.slot, kind)
    if engine.shard is not None:
        views = engine.shard.gather_views(keys, views)
    n = len(keys)
    return {f"{p}:{k}": views[i * n + j].detach().cpu().clone()
            for i, p in enumerate("AB") for j, k in enumerate(keys)}


@torch.no_grad()
def _random_b(engine, adapter_id: str, seed: int) -> None:
    """Non-zero lora_B (it starts at zero, which would hide A's gradients), drawn whole."""
    a = engine.pool.get(adapter_id)
    gen = torch.Generator().manual_seed(seed)
    for k in a.bank.shapes:
        full = torch.randn((engine.model.targets[k][1], a.config.rank), generator=gen) * 0.1
        if engine.shard is not None:
            full = engine.shard.local_lora(k, "B", full)
        a.bank.B[k][a.slot].copy_(full)
    a.bank.stale.add(a.slot)


def _requests(vocab: int) -> list[ForwardBackwardRequest]:
    gen = torch.Generator().manual_seed(7)

    def datum(n):
        seq = torch.randint(0, vocab, (n + 1,), generator=gen)
        return Datum(seq[:-1], {"target_tokens": seq[1:]})

    # Two rollouts of one 40-token prompt: their first 39 positions are computed once
    # (engine/shared_prefix.py), on each rank's slice alike.
    prompt = torch.randint(0, vocab, (40,), generator=gen)
    rollouts = [torch.cat([prompt, torch.randint(0, vocab, (n,), generator=gen)]) for n in (4, 6)]
    shared = [Datum(s[:-1], {"target_tokens": s[1:]}) for s in rollouts]
    return [ForwardBackwardRequest("a", [datum(9), datum(5), *shared]),
            ForwardBackwardRequest("b", [datum(7)]),
            ForwardBackwardRequest(None, [datum(4)], forward_only=True)]


def run(engine, save_dir: Path | None) -> dict:
    vocab = engine.model.vocab_size
    out: dict = {}
    engine.add_adapter("a", LoraConfig(rank=4, alpha=8, seed=1))
    engine.add_adapter("b", LoraConfig(rank=4, alpha=8, seed=2, train_unembed=False))
    _random_b(engine, "a", 3)
    _random_b(engine, "b", 4)
    out["init"] = _whole(engine, "a", "w")
    results = engine.forward_backward(_requests(vocab))  # one mixed-adapter pass
    out["logprobs"] = [[o["logprobs"].clone() for o in r.outputs] for r in results]
    out["loss"] = [r.metrics.get("loss:sum") for r in results]
    if engine.shard is not None:  # what the optimizer step would sum, summed now
        engine.shard.reduce_grads([engine.pool.get("a"), engine.pool.get("b")])
    out["grads_a"] = _whole(engine, "a", "g")
    out["grads_b"] = _whole(engine, "b", "g")
    engine.zero_grad("a")
    engine.zero_grad("b")
    engine.forward_backward(_requests(vocab))
    steps = engine.optim_steps([("a", AdamParams(learning_rate=1e-2, grad_clip_norm=0.5)),
                                ("b", AdamParams(learning_rate=1e-2))])
    out["grad_norm"] = [s.metrics["grad_norm:mean"] for s in steps]
    out["stepped"] = _whole(engine, "a", "w")
    # Parked in host memory and back (workers/parked.py): each rank its own slices
    tier = HostTier(engine)
    tier.park("a")
    engine.add_adapter("x", LoraConfig(rank=4, alpha=8, seed=8))  # takes a's slot
    tier.unpark("a")
    engine.remove_adapter("x")
    after = engine.forward([ForwardBackwardRequest("a", _requests(vocab)[0].data)])
    out["after"] = [o["logprobs"].clone() for o in after[0].outputs]
    # Rows of one length (the padded pass) with top-K targets [S, K]: under a vocabulary
    # split each target's logit is on one rank only.
    gen = torch.Generator().manual_seed(11)
    top_k = [Datum(torch.randint(0, vocab, (6,), generator=gen),
                   {"target_tokens": torch.randint(0, vocab, (6, 3), generator=gen),
                    "weights": torch.rand(6, 3, generator=gen)}) for _ in range(2)]
    engine.zero_grad("a")
    res = engine.forward_backward([ForwardBackwardRequest("a", top_k)])
    out["top_k"] = [o["logprobs"].clone() for o in res[0].outputs]
    if engine.shard is not None:
        engine.shard.reduce_grads([engine.pool.get("a")])
    out["grads_top_k"] = _whole(engine, "a", "g")
    prompt = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(9)).tolist()
    sampled = engine.sample([
        SampleRequest("a", prompt, SamplingParams(max_tokens=8, temperature=0.0, stop=[])),
        SampleRequest("b", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=5,
                                                  stop=[]), num_samples=2),
        SampleRequest(None, prompt, SamplingParams(max_tokens=4, temperature=1.0, stop=[]))])
    out["greedy"] = sampled[0].sequences[0].tokens
    out["seeded"] = [s.tokens for s in sampled[1].sequences]
    out["greedy_lp"] = sampled[0].sequences[0].logprobs
    # The running batch whatever the engine samples with (a tp engine of a dense model
    # takes the padded sampler): the ranks' pages, stacked LoRA slices and shared seed
    padded, engine.padded_sampling = engine.padded_sampling, False
    running = engine.sample([
        SampleRequest("a", prompt, SamplingParams(max_tokens=8, temperature=0.0, stop=[])),
        SampleRequest("b", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=5,
                                                  stop=[]), num_samples=2)])
    engine.padded_sampling = padded
    out["running"] = [s.tokens for r in running for s in r.sequences]
    out["running_lp"] = running[0].sequences[0].logprobs
    # Dimuon: the matrix sign of each whole LoRA matrix (gathered under tp), two steps so
    # that its momentum counts; grad clipping on.
    engine.add_adapter("d", LoraConfig(rank=4, alpha=8, seed=5, optimizer="dimuon"))
    _random_b(engine, "d", 6)
    for _ in range(2):
        engine.forward_backward([ForwardBackwardRequest("d", _requests(vocab)[0].data)])
        engine.optim_steps([("d", DimuonParams(learning_rate=1e-2, grad_clip_norm=0.5))])
    out["dimuon"] = _whole(engine, "d", "w")
    engine.remove_adapter("d")
    if save_dir is not None:
        engine.save("a", save_dir, optimizer=True,
                    write=engine.shard is None or engine.shard.rank == 0)
    for name in ("a", "b"):
        engine.remove_adapter(name)
    return out


def main(args: dict) -> None:
    import torch.distributed as dist

    from twinkled.engine.engine import Engine
    from twinkled.engine.tp import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args["url"], rank=args["rank"],
                            world_size=args["world"])
    tp = TensorParallel(args["tp"])
    results = {}
    for name, model_dir in args["models"].items():
        engine = Engine(model_dir, tp=tp, dp_group=tp.dp_group)
        results[name] = run(engine, Path(args["out"]) / f"{name}-ckpt")
    if dist.get_rank() == 0:
        torch.save(results, Path(args["out"]) / "results.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
