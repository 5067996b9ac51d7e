"""Daemon configuration: one dataclass, filled from defaults, a TOML file, then CLI flags."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path


@dataclass
class Config:
    model: Path | None = None  # a Hugging Face model directory
    model_name: str | None = None  # what clients pass as base_model; default: the dir's name
    data_dir: Path = Path("./twinkle-data")
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "bfloat16"  # float32 on a CPU-only box
    device: str = "auto"  # "cpu", "cuda", "cuda:1", or auto (one worker)
    devices: list[str] = field(default_factory=list)  # one worker per device: cuda:0,cuda:1
    workers: int = 1  # ranks when `devices` is not given (CPU boxes: gloo workers)
    worker_threads: int = 0  # torch threads per CPU worker (0: cores / workers)
    persist_every: int = 1  # persist live adapters after every N-th optimizer step
    step_timeout_s: float = 900.0  # a step not answered by then restarts the worker group
    drain_timeout_s: float = 60.0  # SIGTERM: time for queued work before it is failed
    max_rank: int = 128
    token_budget: int = 16384  # padded tokens per micro-batch (activation memory)
    poll_seconds: float = 30.0  # retrieve_future long-poll (client times out at 45 s)
    fwdbwd_max_chunk_len: int = 1024  # datums per forward_backward request (client chunks)
    sample_budget: int = 65536  # prompt + new tokens per sampling step
    gather_ms: float = 20.0  # wait for the last step's clients to send more, at most this
    # Default quotas for every tenant (None: unlimited); `ctl tenants set` overrides them.
    tenant_max_queued_requests: int | None = None
    tenant_max_queued_tokens: int | None = None
    tenant_max_adapters: int | None = None
    tenant_max_rank: int | None = None
    # Per-tenant settings: {"alice": {"weight": 2, "max_queued_requests": 64}, ...}
    tenants: dict = field(default_factory=dict)

    @property
    def served_name(self) -> str:
        return self.model_name or (self.model.name if self.model else "")

    @classmethod
    def load(cls, path: Path | None, **overrides) -> Config:
        values: dict = {}
        if path is not None:
            raw = tomllib.loads(Path(path).read_text())
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(raw) - known)
            if unknown:
                raise ValueError(f"{path}: unknown keys {unknown}; known: {sorted(known)}")
            values.update(raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        for key in ("model", "data_dir"):
            if values.get(key) is not None:
                values[key] = Path(values[key])
        return cls(**values)

    def worker_devices(self) -> list[str]:
        """One device per worker rank. "auto" asks a child process whether CUDA is there,
        so that the daemon itself never imports torch."""
        if self.devices:
            return list(self.devices)
        device = self.device
        if device == "auto":
            device = "cuda" if _cuda_count() > 0 else "cpu"
        if device == "cuda":
            return [f"cuda:{i}" for i in range(self.workers)]
        return [device] * self.workers


def _cuda_count() -> int:
    import subprocess
    import sys

    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=120, check=True)
        return int(out.stdout.strip() or 0)
    except (subprocess.SubprocessError, ValueError):
        return 0
