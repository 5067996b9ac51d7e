"""Start-up: where the engine runs (in this process, or a daemon), and the device mesh.

`initialize(mode="local")` runs the engine in-process; under `torchrun` with
`DeviceMesh.from_sizes(dp_size=N)` each rank holds a copy of the adapters, the DataLoader
gives each rank its share of every global batch, and LoRA gradients are summed across
ranks before each optimizer step (the engine's data parallelism). `init_twinkle_client`
(client.py) points the same script at a `twinkled` daemon instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

_LOG_FORMAT = "[%(levelname)s:twinkle] %(message)s"


@dataclass
class DeviceMesh:
    """A parallel topology. This release runs data parallelism only (the engine shards no
    weights: LoRA adapters are small, and the frozen base is replicated)."""

    dp_size: int = 1
    fsdp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    world_size: int | None = None

    @classmethod
    def from_sizes(cls, **sizes: int) -> DeviceMesh:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(sizes) - known)
        if unknown:
            raise ValueError(f"unknown mesh dimensions {unknown}; known: {sorted(known)}")
        mesh = cls(**sizes)
        other = {k: v for k, v in sizes.items() if k not in ("dp_size", "world_size") and v != 1}
        if other:
            raise NotImplementedError(
                f"{other}: only data parallelism (dp_size) is supported; fsdp/tp/pp/cp/ep "
                "shard the base model, which a LoRA engine keeps replicated")
        return mesh

    @property
    def size(self) -> int:
        return self.world_size or self.dp_size


@dataclass
class _Runtime:
    mode: str | None = None
    mesh: DeviceMesh = field(default_factory=DeviceMesh)
    seed: int = 42
    client: object | None = None  # a TwinkleClient after init_twinkle_client


runtime = _Runtime()


def initialize(mode: str = "local", global_device_mesh: DeviceMesh | None = None,
               seed: int = 42, **_ignored) -> None:
    """`mode="local"`: the engine runs in this process (under torchrun, one per rank).
    Ray and the HTTP server mode of the seed documents are `twinkled serve` here."""
    if mode != "local":
        raise ValueError(f"mode {mode!r} is not supported: use mode='local' (in-process, "
                         "also under torchrun) or init_twinkle_client(base_url, api_key) "
                         "to train on a twinkled daemon")
    runtime.mode, runtime.seed = mode, seed
    runtime.mesh = global_device_mesh or DeviceMesh()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if runtime.mesh.size > 1 or world > 1:
        if world != runtime.mesh.size:
            raise ValueError(f"the mesh has dp_size={runtime.mesh.size} but {world} processes "
                             "were started: launch with torchrun --nproc_per_node=<dp_size>")
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)


def rank_and_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return 0, 1


def get_logger() -> logging.Logger:
    log = logging.getLogger("twinkle")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def get_device_placement() -> str:
    rank, world = rank_and_world()
    where = runtime.client.base_url if runtime.client is not None else "in-process"
    return f"mode={runtime.mode or 'local'} rank={rank}/{world} engine={where}"
