"""How many aten ops a training step issues, per decoder layer and for the rest (head,
loss, optimizer): the host-bound fixed cost of a small step is roughly ops x launch time.
Counted below autograd (TorchDispatchMode: views and allocations included, as a GPU
launch queue sees them; bf16 by default, as on a GPU), on a tiny Qwen3 (the 8B's module set) at 2 and 4 layers: the
difference over 2 is one layer's ops.

    python bench/count_step_ops.py --adapters 1 --adapters 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_engine import tenant_rows  # noqa: E402

from twinkled.engine.engine import Engine  # noqa: E402
from twinkled.engine.tiny import build_tiny_model  # noqa: E402
from twinkled.protocol.types import AdamParams  # noqa: E402

# Ops that make a view or read a number: host work, but no kernel on a GPU.
VIEWS = {"view", "_unsafe_view", "t", "transpose", "slice", "select", "detach", "expand",
         "unsqueeze", "squeeze", "split", "chunk", "as_strided", "alias", "permute",
         "lift_fresh", "_local_scalar_dense"}


def kernels(ops: Counter) -> int:
    return sum(v for k, v in ops.items() if k not in VIEWS)


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count(layers: int, adapters: int, seq: int, tmp: Path, dtype: torch.dtype
          ) -> tuple[Counter, Counter]:
    d = tmp / f"m{layers}"
    if not d.exists():
        build_tiny_model(d, num_layers=layers)
    eng = Engine(d, dtype=dtype)
    names, reqs = tenant_rows(eng, adapters, seq)
    opt = [(n, AdamParams(learning_rate=1e-4)) for n in names]
    eng.forward_backward(reqs)  # warm: lazily built state is not a step's cost
    eng.optim_steps(opt)
    with Count() as fb:
        eng.forward_backward(reqs)
    with Count() as op:
        eng.optim_steps(opt)
    return fb.ops, op.ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", type=int, action="append")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                    help="bfloat16 (the GPU's) counts the casts a GPU step makes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.adapters or [1]:
            dtype = getattr(torch, args.dtype)
            fb2, op = count(2, n, args.seq, Path(tmp), dtype)
            fb4, _ = count(4, n, args.seq, Path(tmp), dtype)
            layer = Counter({k: (fb4[k] - fb2[k]) // 2 for k in fb4 if fb4[k] != fb2[k]})
            rest = sum(fb2.values()) - 2 * sum(layer.values())
            rest_k = kernels(fb2) - 2 * kernels(layer)
            print(f"{n} adapter(s) x {args.seq}: {sum(layer.values())} ops a layer (fwd+bwd; "
                  f"{kernels(layer)} not views), {rest} outside the layers ({rest_k}), "
                  f"optimizer {sum(op.values())} ({kernels(op)})")
            print("  a layer:", ", ".join(f"{k} {v}" for k, v in layer.most_common(args.top)))
            print("  optimizer:", ", ".join(f"{k} {v}" for k, v in op.most_common(args.top)))


if __name__ == "__main__":
    main()
