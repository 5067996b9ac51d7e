"""A full-parameter run over a data-parallel lane of 2 ranks (rows split; gradients summed
onto each parameter's owner, the masters and moments split between the ranks) equals the
run on one rank, and so does its checkpoint (gathered from the owners).

On 2 CUDA GPUs it runs over nccl, elsewhere over gloo on the CPUs (about 16 s on 2 cores).
"""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
STEPS = 3


def _data(vocab: int) -> list:
    from helpers import random_datum

    gen = torch.Generator().manual_seed(5)
    return [random_datum(gen, n, vocab) for n in (7, 5, 9, 6)]


def _train(model_dir, rank: int, world: int, group, save_to: str) -> dict[str, torch.Tensor]:
    from twinkled.engine.engine import Engine
    from twinkled.protocol.types import AdamParams, ForwardBackwardRequest, LoraConfig

    device = f"cuda:{rank}" if GPUS else "cpu"
    eng = Engine(model_dir, device=device, dp_group=group)
    eng.add_adapter("full", LoraConfig(rank=0))
    data = _data(eng.model.vocab_size)
    for step in range(STEPS):
        # rank r runs rows r, r + world, ...; at the last step rank 1 runs none at all
        mine = [d for i, d in enumerate(data) if i % world == rank
                and not (world > 1 and step == STEPS - 1 and rank == 1)]
        if world > 1 and step == STEPS - 1 and rank == 0:
            mine = data
        if mine:
            eng.forward_backward([ForwardBackwardRequest("full", mine)])
        assert eng.optim_step("full", AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)).applied
    if world > 1:  # each rank holds only its share of the masters and moments
        held = [w is not None for w in eng.full.master]
        assert any(held) and not all(held)
    eng.save("full", save_to, write=rank == 0)  # gathered from the ranks that own it
    return {n: p.detach().float().cpu().clone() for n, p in eng.model.hf.named_parameters()}


def _rank(rank: int, port: int, model_dir, save_to, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl" if GPUS else "gloo", rank=rank, world_size=2,
                            init_method=f"tcp://127.0.0.1:{port}")
    out[rank] = _train(model_dir, rank, 2, dist.group.WORLD, save_to)
    dist.destroy_process_group()


def test_two_ranks_train_as_one(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, str(tiny_dir), str(tmp_path / "two"), out), nprocs=2,
                 join=True)
        got = dict(out)
    want = _train(str(tiny_dir), 0, 1, None, str(tmp_path / "one"))
    for name, w in want.items():
        for rank in (0, 1):
            assert torch.allclose(got[rank][name], w, atol=1e-5), (name, rank)
    for f in ("model.safetensors", "optimizer.safetensors"):  # masters and moments
        one, two = load_file(tmp_path / "one" / f), load_file(tmp_path / "two" / f)
        assert one.keys() == two.keys()
        assert all(torch.allclose(one[k], two[k], atol=1e-5) for k in one), f
