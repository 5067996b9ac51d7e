"""Gradient sums over data-parallel ranks (engine/parallel.py), on two gloo processes.

Adapters whose rows all ran on one rank are broadcast from it, the others all-reduced;
either way every rank must end with the sum of all ranks' gradients and pending counts."""

from __future__ import annotations

import socket
import zlib

import torch
import torch.multiprocessing as mp

# name -> the ranks that ran rows of it (and hold gradients)
HOLDERS = {"solo0": [0], "solo1": [1], "split": [0, 1], "idle": [], "solo0b": [0]}
TARGETS = {"model.layers.0.self_attn.q_proj": (8, 8), "model.layers.0.mlp.up_proj": (8, 16)}


def _grads(name: str, rank: int, like: torch.Tensor) -> torch.Tensor:
    """What rank `rank` holds for adapter `name` before the sum."""
    if rank not in HOLDERS[name]:
        return torch.zeros_like(like)
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{rank}".encode()))
    return torch.randn(like.shape, generator=g)


def _rank(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    from twinkled.engine.lora import LoraPool
    from twinkled.engine.parallel import reduce_gradients
    from twinkled.protocol.types import LoraConfig

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    pool = LoraPool(TARGETS, max_rank=4, device="cpu")
    adapters = [pool.add(name, LoraConfig(rank=4, seed=1)) for name in HOLDERS]
    for a in adapters:
        flat = a.bank.flat(a.slot, "g")
        flat.copy_(_grads(a.id, rank, flat))
        a.pending = 3 if rank in HOLDERS[a.id] else 0
    reduce_gradients(adapters, None)
    out[rank] = {a.id: (a.bank.flat(a.slot, "g").clone(), a.pending) for a in adapters}
    dist.destroy_process_group()


def test_each_rank_ends_with_the_sum_whoever_held_the_gradients():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, out), nprocs=2, join=True)
        got = dict(out)
    for name, holders in HOLDERS.items():
        like = got[0][name][0]
        want = _grads(name, 0, like) + _grads(name, 1, like)
        for rank in (0, 1):
            grads, pending = got[rank][name]
            assert torch.allclose(grads, want, atol=1e-6), (name, rank)
            assert pending == 3 * len(holders), (name, rank)
    assert got[0]["solo1"][0].abs().sum() > 0  # rank 0 received what only rank 1 held
