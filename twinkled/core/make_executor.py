"""How a lane's executor is made: the options every worker of a lane starts with, the
worker group over ZeroMQ (`zmq_executor`, the daemon's), or the engine in this process
(`in_process_executor`: tests, a box without workers). The executor itself, what it does
with a step, is executor.py's."""

from __future__ import annotations

import os
from pathlib import Path

from twinkled.core.adapter_room import gpu_budget
from twinkled.core.executor import Executor
from twinkled.protocol.blobs import store_spec
from twinkled.protocol.config import Config
from twinkled.protocol.sizing import GiB
from twinkled.workers.hosts import HostRegistry, join_settings
from twinkled.workers.supervisor import WorkerGroup

# A GPU worker's host work is launching kernels and moving small arrays: one thread does it.
# torch's default, a thread per core in every worker, gives N workers N x cores threads
# on one box's cores. Measured on 2 x H100 (bench_workers, 2 vs 32 threads per worker):
# no difference beyond the run-to-run spread, so this is hygiene, not a speed-up.
GPU_WORKER_THREADS = 2


def default_threads(devices: list[str], groups: int = 1) -> int:
    """torch threads per worker of `groups` groups of `devices` each: CPU workers share
    the cores (or take OMP_NUM_THREADS, the usual knob of a shared CPU box, when it is
    set); GPU workers need few."""
    if all(d.startswith("cuda") for d in devices):
        return GPU_WORKER_THREADS
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return max(1, (os.cpu_count() or 1) // (len(devices) * groups))


def zmq_executor(config: Config, devices: list[str], hosts: HostRegistry | None = None,
                 adapter_budget: int | None = None) -> Executor:
    """The daemon's executor for one lane (`Config.lane_devices`): a worker process per
    device of `devices`, driven over ZeroMQ; with `hosts`, the daemon's registry of joined
    hosts, also ranks on the hosts that bring ranks (not lanes). `adapter_budget`: as
    `worker_options`'."""
    group = WorkerGroup(devices, worker_options(config, devices, adapter_budget),
                        step_timeout=config.step_timeout_s,
                        join=join_settings(config) if hosts else None, hosts=hosts)
    return Executor(group, Path(config.data_dir) / "live", config.persist_every,
                    config.journal_fsync)


def worker_options(config: Config, devices: list[str], adapter_budget: int | None = None
                   ) -> dict:
    """What every worker of a lane on `devices` is started with (worker.py).
    `adapter_budget`: bytes per rank for adapters (`layout.adapters_budget`; None: no
    limit): with `adapter_memory_gb` (`gpu_budget`), what caps the LoRA banks' growth."""
    threads = config.worker_threads or default_threads(devices, config.lanes)
    live_dir = Path(config.data_dir) / "live"
    return {"model": str(config.model), "dtype": config.dtype,
               "max_rank": config.max_rank, "token_budget": config.token_budget,
               "sample_kv_mb": config.sample_kv_mb, "sample_rows": config.sample_rows,
               "sample_prefix_cache": config.sample_prefix_cache,
               "packing": config.packing, "shared_prefix": config.shared_prefix,
               "fused_kernels": config.fused_kernels,
               "tp": config.tp, "ep": config.ep, "cp": config.cp,
               "cp_min_tokens": config.cp_min_tokens,
               "max_seq_len": config.max_seq_len, "rope_scaling": config.rope_scaling,
               "activation_checkpointing": config.activation_checkpointing,
               "live_dir": str(live_dir), "persist_every": config.persist_every,
               "logprob_gap_every": config.logprob_gap_every,
               "threads": threads, "log_format": config.log_format,
               "checkpoint_store": store_spec(config),
               "bank_max_bytes": gpu_budget(config, adapter_budget),
               "host_max_bytes": int(config.host_adapter_memory_gb * GiB)}


def in_process_executor(config: Config) -> Executor:
    """The engine in this process (one rank, no ZeroMQ): tests, and a box without workers."""
    from twinkled.workers.inprocess import InProcessGroup

    live_dir = Path(config.data_dir) / "live"
    device = config.worker_devices()[0]
    # bf16 matmuls on a CPU are slow and gain nothing here (as a worker process decides)
    dtype = "float32" if device == "cpu" and config.dtype == "bfloat16" else config.dtype
    group = InProcessGroup(config.model, device=device, dtype=dtype, max_rank=config.max_rank,
                           token_budget=config.token_budget, packing=config.packing,
                           shared_prefix=config.shared_prefix,
                           fused_kernels=config.fused_kernels,
                           max_seq_len=config.max_seq_len, rope_scaling=config.rope_scaling,
                           sample_kv_mb=config.sample_kv_mb, sample_rows=config.sample_rows,
                           live_dir=live_dir, persist_every=config.persist_every,
                           sample_prefix_cache=config.sample_prefix_cache,
                           logprob_gap_every=config.logprob_gap_every,
                           checkpoint_store=store_spec(config),
                           bank_max_bytes=gpu_budget(config, None),
                           host_max_bytes=int(config.host_adapter_memory_gb * GiB))
    return Executor(group, live_dir, config.persist_every, config.journal_fsync)
