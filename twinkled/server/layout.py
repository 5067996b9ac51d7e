"""The worker layout, checked before any worker starts: devices x tensor parallelism, and
whether the model fits on the cards it is given.

Torch-free: the devices' memory comes from a child process (as `Config.worker_devices`
asks whether CUDA is there), and the model's needs from its config.json
(`twinkled.protocol.sizing`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from twinkled.protocol.config import Config
from twinkled.protocol.sizing import (
    DTYPE_BYTES,
    FULL_RUN_KV_BYTES,
    GiB,
    adapter_budget,
    split_problem,
    step_bytes,
    weight_bytes,
)

_RANGE = re.compile(r"cuda:(\d+)-(\d+)")
# What may stay free of the estimate: CUDA context, allocator slack, the estimate's error.
HEADROOM = 0.92


def expand_devices(text: str) -> list[str]:
    """"cuda:0-3,cpu" -> ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cpu"]."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        m = _RANGE.fullmatch(part)
        if m and int(m[1]) <= int(m[2]):
            out += [f"cuda:{i}" for i in range(int(m[1]), int(m[2]) + 1)]
        elif part:
            out.append(part)
    return out


def _gpu_memory() -> list[int]:
    """Total memory of each CUDA device here ([] when there is none)."""
    probe = ("import json, torch; print(json.dumps([torch.cuda.get_device_properties(i)"
             ".total_memory for i in range(torch.cuda.device_count())] "
             "if torch.cuda.is_available() else []))")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=120, check=True)
        return [int(x) for x in json.loads(out.stdout.strip() or "[]")]
    except (subprocess.SubprocessError, ValueError):
        return []


def _gpus(devices: list[str]) -> list[int]:
    """The CUDA card indices among worker devices ("cuda" is card 0)."""
    return sorted({int(d.partition(":")[2] or 0) for d in devices if d.startswith("cuda")})


def gpu_memory(cfg: Config) -> list[int]:
    """The sizes of this box's CUDA cards ([] when the workers use none)."""
    return _gpu_memory() if _gpus(cfg.worker_devices()) else []


KV_SHARE = 0.3  # of what a card has after the weights and a micro-batch, when not set
KV_FLOOR_MB = 4096


def kv_pool_mb(cfg: Config, memory: list[int]) -> int:
    """The sampler's KV pool per worker, in MiB: `sample_kv_mb` if set; else (0) on GPUs
    `KV_SHARE` of what the smallest card has left after the base weights and a recomputed
    `token_budget` micro-batch (at least `KV_FLOOR_MB`), the rest going to adapters. A pool
    that holds few rows caps decode at a few dozen sequences at once on an 8B (4 GiB: ~37
    rows of 768 tokens), however many the card could run; 0 on CPUs (the worker's own
    default)."""
    free = None if cfg.sample_kv_mb else _left(cfg, memory, 0)
    return cfg.sample_kv_mb if free is None else max(KV_FLOOR_MB, int(KV_SHARE * free) >> 20)


def adapters_budget(cfg: Config, memory: list[int]) -> int | None:
    """Bytes per rank that loaded adapters may take (`AdapterRoom`): what the sizing
    estimate leaves of the smallest card in use; None (no limit) without GPUs."""
    return _left(cfg, memory, (cfg.sample_kv_mb or KV_FLOOR_MB) << 20)


def full_run_room(cfg: Config, memory: list[int]) -> int | None:
    """Bytes per rank a full-parameter run's state may take on its lane (core/exclusive.py):
    the smallest card in use less the base weights, a micro-batch and the KV pool its lane
    samples with while it lives, which the engine makes at the first sample (not at start)
    and caps at FULL_RUN_KV_BYTES then: not the configured pool, which is sized for many
    LoRA tenants (an 8B full run on 2 x H200 fits beside 4 GiB, not beside 26 GiB). The
    lane holds no adapters meanwhile. None (no limit) without GPUs."""
    return _left(cfg, memory, min((cfg.sample_kv_mb or KV_FLOOR_MB) << 20, FULL_RUN_KV_BYTES),
                 chunked_head=False)  # (a full run's head keeps the whole logits: full_param.py)


def _left(cfg: Config, memory: list[int], kv_bytes: int, chunked_head: bool = True
          ) -> int | None:
    """What the sizing estimate leaves of the smallest card in use after the base weights,
    a recomputed `token_budget` micro-batch and a KV pool of `kv_bytes` (None: no GPUs,
    or their sizes unknown)."""
    gpus, model = _gpus(cfg.worker_devices()), cfg.model_config
    if not gpus or not model or any(g >= len(memory) for g in gpus):
        return None
    return adapter_budget(model, min(memory[g] for g in gpus), DTYPE_BYTES.get(cfg.dtype, 2),
                          cfg.token_budget, cfg.tp, kv_bytes, HEADROOM, chunked_head)


def _cp_problems(cfg: Config, lane_ranks: int, ranks: int) -> list[str]:
    """Context parallelism (engine/context_parallel.py) splits rows over groups of `cp`
    consecutive ranks of a lane; it composes with data parallelism only (for now)."""
    if cfg.cp <= 1:
        return []
    if cfg.tp > 1 or cfg.ep > 1:
        return ["cp: --cp composes with data parallelism only: leave --tp and --ep at 1"]
    if cfg.remote_ranks or cfg.join_listen:
        return ["cp: a context-parallel group gathers keys every layer: no other hosts "
                "(remote_ranks, join_listen)"]
    if ranks % cfg.cp or lane_ranks % cfg.cp:
        return [f"cp: --cp {cfg.cp} must divide each lane's {lane_ranks} worker ranks"]
    return []


def layout_problems(cfg: Config, gpu_memory: list[int] | None = None) -> list[str]:
    """What is wrong with serving `cfg.model` on `cfg`'s devices at `cfg.tp` (one line
    each; [] when nothing is). `gpu_memory`: the cards' sizes (default: probed)."""
    if cfg.lanes == 0:  # no workers here: the hosts that join check their own lanes
        return (["lanes: 0 (no workers here) needs join_listen: the lanes come from the "
                 "hosts that join"] if not cfg.join_listen else []) + \
            (["lanes: 0 takes hosts as lanes only, not remote_ranks"] if cfg.remote_ranks
             else [])
    tp = cfg.tp
    devices = cfg.worker_devices()
    ranks = len(devices) + cfg.remote_ranks
    problems = []
    if tp > 1 and cfg.remote_ranks and (len(devices) % tp or cfg.remote_ranks % tp):
        # Each host brings whole tensor-parallel groups: NCCL inside a host, data
        # parallelism between hosts (a group split over the network would crawl).
        problems.append(f"tp: each host's ranks must make whole groups of {tp}: this host "
                        f"has {len(devices)}, remote_ranks is {cfg.remote_ranks}")
    if ranks % tp:
        problems.append(f"tp: {tp} does not divide the {ranks} worker devices {devices}")
    if cfg.lanes > 1 and len(devices) % cfg.lanes:
        problems.append(f"lanes: {cfg.lanes} does not divide the {len(devices)} worker "
                        f"devices {devices}")
    elif cfg.lanes > 1 and (len(devices) // cfg.lanes) % tp:
        problems.append(f"lanes: each lane's {len(devices) // cfg.lanes} device(s) must make "
                        f"whole tensor-parallel groups of {tp}")
    if cfg.lanes > 1 and cfg.remote_ranks:
        problems.append("lanes: a daemon with lanes takes no other hosts' ranks "
                        "(remote_ranks): hosts bring lanes of their own (twinkled worker "
                        "--lanes N)")
    if cfg.ep > 1 and tp > 1:
        problems.append("ep: under --tp the experts are already split over each tensor-"
                        "parallel group; use --tp alone (or --ep without --tp)")
    elif cfg.ep < 1 or ranks % cfg.ep:
        problems.append(f"ep: --ep {cfg.ep} must divide the {ranks} worker ranks (--devices / "
                        "--workers)")
    elif cfg.lanes > 1 and (len(devices) // cfg.lanes) % cfg.ep:
        problems.append(f"ep: --ep {cfg.ep} must divide each lane's "
                        f"{len(devices) // cfg.lanes} worker ranks")
    problems += _cp_problems(cfg, len(devices) // max(1, cfg.lanes), ranks)
    model = cfg.model_config
    if tp > 1 and model and (why := split_problem(model, tp)) is not None:
        problems.append(f"tp: {why}")
    gpus = _gpus(devices)
    if not gpus:
        return problems
    memory = _gpu_memory() if gpu_memory is None else gpu_memory
    missing = [g for g in gpus if g >= len(memory)]
    if missing:
        problems.append(f"devices: cuda:{missing[0]} is not here ({len(memory)} CUDA "
                        f"device(s) present)")
        return problems
    if model and not problems:
        problems += _fit_problems(cfg, model, min(memory[g] for g in gpus), len(devices))
    return problems


def _fit_problems(cfg: Config, model: dict, card: int, n_devices: int) -> list[str]:
    """The model's weights, one adapter and one micro-batch with recomputed activations
    (the least a step can take) must fit one card at this tp."""
    dtype_bytes = DTYPE_BYTES.get(cfg.dtype, 2)
    need = step_bytes(model, dtype_bytes, cfg.token_budget, cfg.tp, recompute=True,
                      rank=min(cfg.max_rank, 32), adapters=1)
    if need <= HEADROOM * card:
        return []
    fits = [t for t in range(cfg.tp + 1, n_devices + 1)
            if n_devices % t == 0 and split_problem(model, t) is None
            and step_bytes(model, dtype_bytes, cfg.token_budget, t, recompute=True,
                           rank=min(cfg.max_rank, 32), adapters=1) <= HEADROOM * card]
    hint = (f"; --tp {fits[0]} would fit" if fits else
            "; more cards (a larger --tp) or a smaller token_budget are needed")
    return [f"model: {cfg.served_name} needs about {need / GiB:.1f} GiB per GPU at tp "
            f"{cfg.tp} (weights {weight_bytes(model, dtype_bytes, cfg.tp) / GiB:.1f} GiB), "
            f"more than the {card / GiB:.1f} GiB cards hold{hint}"]


def layout_summary(cfg: Config) -> str:
    """One line for the start-up log: how the devices are grouped, and, where several
    local GPUs make one data-parallel group, that lanes serve many small tenants better
    (4 x H100, 0.5B: 3.84x one GPU on 4 lanes against 1.50x as one group; BENCHMARKS.md)."""
    if cfg.lanes == 0:
        return f"no workers here (lanes 0): lanes come from the hosts that join {cfg.join_listen}"
    devices = cfg.worker_devices()
    per_lane = len(devices) // cfg.lanes
    line = (f"{cfg.lanes} lane(s) of {per_lane} worker rank(s) on {', '.join(devices)}"
            f" (tp {cfg.tp}, ep {cfg.ep}"
            + (f", {cfg.remote_ranks} remote rank(s)" if cfg.remote_ranks else "") + ")")
    replicas = len(devices) // max(cfg.tp, cfg.ep)
    if cfg.lanes == 1 and replicas > 1 and not (cfg.remote_ranks or cfg.join_listen):
        line += (f"; for many small tenants, --lanes {replicas} puts each run on its own "
                 "worker group and scales better (docs/operator.md, section 5c)")
    return line


def host_memory_warning(cfg: Config, machine_bytes: int | None = None) -> str | None:
    """A warning when the workers' host tiers take more than 80% of this machine's memory:
    each GPU worker pins its `host_adapter_memory_gb` from the start (a tensor-parallel
    rank its share; engine/host_arena.py), which the kernel cannot swap, so the machine
    runs out for everything else (a 1,000-run bench lost its worker so). `machine_bytes`:
    the machine's memory (default: read from the system)."""
    ranks = sum(d.startswith("cuda") for d in cfg.worker_devices())
    if not ranks:
        return None  # (parked in pageable memory there, which the kernel can swap)
    if machine_bytes is None:
        try:
            import os

            machine_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    tp = max(cfg.tp, 1)
    total = cfg.host_adapter_memory_gb * GiB * ranks / tp
    if total <= 0.8 * machine_bytes:
        return None
    split = f" / tp {tp}" if tp > 1 else ""
    return (f"host_adapter_memory_gb {cfg.host_adapter_memory_gb:g} x {ranks} GPU worker(s)"
            f"{split} = {total / GiB:.0f} GiB of pinned memory for parked adapters, made at "
            f"start, more than 80% of this machine's {machine_bytes / GiB:.0f} GiB: the rest "
            "of the machine may run out and the kernel kill a worker; lower "
            "host_adapter_memory_gb (docs/operator.md 5d)")
