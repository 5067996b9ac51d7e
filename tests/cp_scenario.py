"""One training scenario with long rows, run alike by a whole engine (in the test process)
and by each rank of a context-parallel group of 2 (`python tests/cp_scenario.py`), so
tests/test_cp.py can compare what they give. Each rank of the group writes its results
with torch.save."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import torch

from twinkled.protocol.types import Datum, ForwardBackwardRequest, LoraConfig

MIN_TOKENS = 32  # rows longer than this are split (the tiny model's "chunk")


def requests(vocab: int) -> list[ForwardBackwardRequest]:
    """Tenant a's long rows (cross-entropy with weights; gspo, whose sequence ratio couples
    a row's tokens), the base model's long forward-only row, and tenant b's short rows."""
    gen = torch.Generator().manual_seed(7)

    def datum(n, **extra):
        seq = torch.randint(0, vocab, (n + 1,), generator=gen)
        return Datum(seq[:-1], {"target_tokens": seq[1:], **extra})

    long_ce = [datum(150, weights=torch.rand(150, generator=gen)), datum(97)]
    n = 120
    gspo = datum(n, logprobs=-torch.rand(n, generator=gen) * 3 - 5,
                 advantages=torch.randn(n, generator=gen),
                 sequence_ratio_mask=(torch.rand(n, generator=gen) > 0.3).float())
    return [ForwardBackwardRequest("a", long_ce),
            ForwardBackwardRequest("b", [datum(10), datum(7), datum(12)]),
            ForwardBackwardRequest("a", [gspo], loss_fn="gspo"),
            ForwardBackwardRequest(None, [datum(70)], forward_only=True)]


# Which of tenant b's short rows each rank of the group runs (the data-parallel split).
SHORT = {0: [0, 2], 1: [1]}


def setup(engine) -> None:
    engine.add_adapter("a", LoraConfig(rank=4, alpha=8, seed=1))
    engine.add_adapter("b", LoraConfig(rank=4, alpha=8, seed=2))
    for name, seed in (("a", 3), ("b", 4)):
        a = engine.pool.get(name)
        gen = torch.Generator().manual_seed(seed)
        for k in a.bank.shapes:
            b = a.bank.B[k][a.slot]
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
        a.bank.changed(a.slot)


def grads(engine, name: str) -> dict[str, torch.Tensor]:
    a = engine.pool.get(name)
    return {f"{p}:{k}": g[k][a.slot].detach().float().cpu().clone()
            for p, g in (("A", a.bank.gA), ("B", a.bank.gB)) for k in a.bank.shapes}


def results(engine, reqs, out) -> dict:
    return {"logprobs": [[o["logprobs"].float().cpu() for o in r.outputs] for r in out],
            "loss": [[o["elementwise_loss"].float().cpu() for o in r.outputs] for r in out],
            "grads_a": grads(engine, "a"), "grads_b": grads(engine, "b"),
            "pending": [engine.pool.get(n).pending for n in "ab"]}


def frames(reqs: list[ForwardBackwardRequest]) -> list:
    """The requests as a step's TrainF ops."""
    from twinkled.protocol.frames import DatumF, TrainF
    from twinkled.workers.rank_io import to_buf

    return [TrainF(r.adapter_id, [DatumF(to_buf(torch.as_tensor(d.tokens)),
                                         {k: to_buf(torch.as_tensor(v))
                                          for k, v in d.loss_inputs.items()})
                                  for d in r.data], r.loss_fn, forward_only=r.forward_only)
            for r in reqs]


def main(args: dict) -> None:
    import torch.distributed as dist

    from twinkled.engine.context_parallel import ContextParallel, cp_groups
    from twinkled.engine.engine import Engine
    from twinkled.engine.parallel import reduce_gradients

    torch.set_num_threads(1)
    cuda = args.get("device") == "cuda"  # a GPU per rank, NCCL (test_cp's GPU test)
    if cuda:
        torch.cuda.set_device(args["rank"])
    dist.init_process_group("nccl" if cuda else "gloo", init_method=args["url"],
                            rank=args["rank"], world_size=args["world"])
    cp = ContextParallel(2, MIN_TOKENS, cp_groups(args["rank"], args["world"], 2))
    engine = Engine(args["model"], dp_group=dist.group.WORLD,
                    token_budget=args.get("token_budget", 16384),
                    device=f"cuda:{args['rank']}" if cuda else "cpu",
                    dtype=args.get("dtype", "float32"))
    setup(engine)
    reqs = requests(engine.model.vocab_size)
    short = reqs[1]
    reqs[1] = ForwardBackwardRequest("b", [short.data[j] for j in SHORT[cp.rank]])
    out = engine.forward_backward(reqs, cp=cp)
    reduce_gradients([engine.pool.get("a"), engine.pool.get("b")], dist.group.WORLD,
                     engine.spread)
    got = results(engine, reqs, out)
    # The same step through the worker's StepRunner, as the daemon sends it (whole ops):
    # it picks this rank's rows itself; its outcomes go back for the test to merge.
    from twinkled.protocol.frames import StepF
    from twinkled.workers.runner import StepRunner

    runner = StepRunner(engine, cp.rank, 2, None, cp=cp)
    step = StepF(1, "train", frames(requests(engine.model.vocab_size)))
    got["outcomes"] = msgspec.msgpack.encode(runner.run(step))
    torch.save(got, Path(args["out"]) / f"rank{cp.rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
