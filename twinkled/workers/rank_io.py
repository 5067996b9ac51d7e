"""What a rank's step code shares: frame buffers as tensors and back, and how a failure is
judged (the request's own fault, or one that leaves the rank unusable)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinkled.engine import EngineInputError
from twinkled.protocol.frames import Buf

_DTYPES = {"int64": torch.long, "float32": torch.float32}


def to_tensor(b: Buf) -> torch.Tensor:
    return torch.frombuffer(bytearray(b.data), dtype=_DTYPES[b.dtype]).reshape(b.shape)


def to_buf(t: torch.Tensor) -> Buf:
    t = t.detach().cpu().contiguous()
    t = t.float() if t.is_floating_point() else t.long()
    return Buf("float32" if t.dtype == torch.float32 else "int64", list(t.shape),
               t.numpy().tobytes())



def fatal(e: BaseException, split: bool = False) -> bool:
    """A fault that leaves this rank unusable or out of step with the others (the group
    restarts). Anything else fails the requests it touched and the worker goes on. `split`
    (tensor parallelism): out of memory too, as the rank's peers wait in the collectives."""
    if isinstance(e, torch.OutOfMemoryError):
        return split
    kinds = tuple(k for k in (getattr(torch.distributed, "DistError", None),
                              getattr(torch, "AcceleratorError", None)) if k is not None)
    text = str(e)
    return (isinstance(e, kinds) or "CUDA error" in text or "NCCL" in text
            or "device-side assert" in text)



def category(e: BaseException) -> str:
    return "user" if isinstance(e, EngineInputError) else "server"


def release(e: BaseException) -> None:
    """After a failed pass: give back what it held, so the next step has the memory."""
    if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available():
        torch.cuda.empty_cache()


def anywhere(flag: bool, device) -> bool:
    """Whether `flag` holds on any rank of the worker group (every rank calls this; one
    all-reduce of one number)."""
    t = torch.tensor([1.0 if flag else 0.0])
    if dist.get_backend() == "nccl":
        t = t.to(device)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return bool(t.item())
