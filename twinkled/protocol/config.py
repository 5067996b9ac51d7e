"""Daemon configuration: one dataclass, filled from defaults, a TOML file, then CLI flags."""

from __future__ import annotations

import difflib
import json
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from functools import cache, cached_property
from pathlib import Path

from twinkled.protocol.checks import Limits as RequestLimits
from twinkled.protocol.config_rules import DEVICE, RANGES, TENANT_KEYS


def default_data_dir() -> Path:
    """Where a daemon keeps its state unless told: never the working directory.

    `$XDG_STATE_HOME/twinkle` (~/.local/state/twinkle): runs, checkpoints and the database are
    state that persists across restarts, not portable data. A data dir that an older version
    made under `$XDG_DATA_HOME/twinkle` is still used when the new one does not exist yet,
    so an upgrade does not lose sight of its runs."""
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    old = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    if not (state / "twinkle").exists() and (old / "twinkle" / "twinkle.db").exists():
        return old / "twinkle"
    return state / "twinkle"


@dataclass
class Config:
    model: Path | None = None  # a Hugging Face model directory
    model_name: str | None = None  # what clients pass as base_model; default: the dir's name
    data_dir: Path = field(default_factory=lambda: default_data_dir())
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "bfloat16"  # float32 on a CPU-only box
    device: str = "auto"  # "cpu", "cuda", "cuda:1", or auto (one worker)
    devices: list[str] = field(default_factory=list)  # one worker per device: cuda:0,cuda:1
    workers: int = 1  # ranks when `devices` is not given (CPU boxes: gloo workers)
    ep: int = 1  # expert parallelism: ranks that split an MoE model's experts (divides ranks)
    tp: int = 1  # tensor-parallel size: each replica of the base model spans tp devices
    cp: int = 1  # context parallelism: ranks a row over cp_min_tokens is split over
    cp_min_tokens: int = 8192  # (engine/context_parallel.py)
    max_seq_len: int = 0  # 0: the model's positions; above: YaRN (engine/long_context.py)
    rope_scaling: dict = field(default_factory=dict)  # as its model card: yarn, factor...
    # Independent worker groups the devices are split into, each with its own step loop;
    # a model lives on one (docs/internals.md, "Scaling over GPUs"). 1: one group.
    lanes: int = 1
    # A run that sends a training row longer than this is long-context: with 2+ lanes it is
    # kept on a lane apart from short runs (core/long_rows.py), since no step can be cut
    # inside one pass and a short tenant beside it would wait the whole long row. 16384:
    # the default token_budget, a row that fills a micro-batch alone (preemptible steps,
    # preempt_ms, cut steps between micro-batches only); 2.5 s a pass of an 8B on an H200,
    # ~10 short tenant steps. 0: off.
    long_row_tokens: int = 16384
    # Recompute activations per layer in the backward: auto (when a step would not fit
    # otherwise), on, off.
    activation_checkpointing: str = "auto"
    worker_threads: int = 0  # torch threads per worker (0: CPU cores / workers; 2 per GPU)
    persist_every: int = 1  # persist live adapters after every N-th optimizer step
    # fsync the journal (one group commit per step) before acknowledging: acknowledged
    # steps survive a power loss, not only a crash (twinkled/core/journal.py)
    journal_fsync: bool = True
    # Where checkpoint files go (protocol/blobs.py): "" = <data_dir>/checkpoints; an absolute
    # path = a directory shared by every host (NFS-style, the same mount path everywhere);
    # s3://BUCKET[/PREFIX] = an S3-compatible object store (the `s3` extra).
    checkpoint_store: str = ""
    checkpoint_store_endpoint: str = ""  # the object store's URL ("": AWS's, or AWS_ENDPOINT_URL_S3)
    idle_unload_s: float = 1800.0  # unload an adapter idle this long (0: never); it comes back on its next request
    step_timeout_s: float = 900.0  # a step not answered by then restarts the worker group
    drain_timeout_s: float = 60.0  # SIGTERM: time for queued work before it is failed
    max_rank: int = 128
    token_budget: int = 16384  # tokens per micro-batch (activation memory)
    packing: bool = True  # rows of mixed lengths run end to end, not padded (engine/packed.py)
    # Packed rows of one adapter sharing at least this many leading positions (an RL
    # group's prompt) compute them once (engine/shared_prefix.py); 0: off.
    shared_prefix: int = 32
    # The decoder layer's fused kernels (engine/fused_ops.py: liger-kernel's RMSNorm, rotary,
    # SiLU-mul on GPUs; joint q/k/v and gate/up GEMMs): "all", "none" (HF's modules op by
    # op, the reference path) or levers comma-separated of norm, rope, silu, gemm.
    fused_kernels: str = "all"
    sample_kv_mb: int = 0  # the sampler's KV page pool per worker (0: sized from the card, 64 on a CPU)
    sample_rows: int = 256  # sequences each worker's sampler decodes at once
    # The share of that pool prompts' KV pages may stay cached in for later requests with
    # the same prefix and weights (engine/prefix_cache.py); 0: no prefix cache.
    sample_prefix_cache: float = 0.5
    # 1 in N finished sampling requests is scored again by the training forward: the gap
    # between the two logprobs is in /metrics and `ctl status` (workers/gaps.py); 0: off.
    logprob_gap_every: int = 16
    # GPU memory per rank for resident adapters; 0: what the sizing estimate leaves of the
    # smallest card (on GPUs; no limit on CPUs). When it is full the least recently used
    # idle adapters are parked, to host memory then to disk (core/tiers.py), never refused.
    adapter_memory_gb: float = 0.0
    # Host memory per lane for adapters parked out of the GPU bank (weights, gradients and
    # moments, exact); beyond it the least recently parked go on to disk. 0: park on disk.
    host_adapter_memory_gb: float = 8.0
    # How long a training step should take, in ms: "auto" derives it from the step times
    # measured on this model (scheduler/cost.py), 0 bounds steps by token_budget only.
    target_step_ms: float | str = "auto"
    # Preemptible training steps (scheduler/joins.py): a step that a recently served tenant
    # may want to join runs in micro-batches of about this many ms, and a small tenant's
    # work that arrives meanwhile runs between two of them, answered at once. "auto": a
    # half the step target; 0: off. One-rank groups only.
    preempt_ms: float | str = "auto"
    poll_seconds: float = 30.0  # retrieve_future long-poll (client times out at 45 s)
    fwdbwd_max_chunk_len: int = 1024  # datums per forward_backward request (client chunks)
    # Prompt + new tokens per sampling step: enough that one step fills a worker's running
    # batch and its stock at once (8 tenants' fan-out, 512 + 256 tokens x 8 samples a
    # request, 0.5B on an H200: 65536 a step admitted the batch in staggered cohorts, whose
    # rows then ended and refilled a few at a time, in small prefill passes: 0.88x the
    # engine alone; 196608: 0.95x, the prefill's seconds 1.07 -> 0.61)
    sample_budget: int = 196608
    # Samples decode in slices of this long between other steps (0: each step's to the end)
    sample_slice_ms: float = 250.0
    # While no other work waits, a slice decodes up to this long (work that arrives ends it
    # at sample_slice_ms); 0: always slices of sample_slice_ms
    sample_long_slice_ms: float = 2000.0
    gather_ms: float = 20.0  # wait for the last step's clients to send more, at most this
    # Default quotas for every tenant (None: unlimited); `ctl tenants set` overrides them.
    tenant_max_queued_requests: int | None = None
    tenant_max_queued_tokens: int | None = None
    tenant_max_adapters: int | None = None
    tenant_max_rank: int | None = None
    # Full-parameter runs (rank 0) at once per tenant, each holding a lane alone; None:
    # unlimited (where `full_runs` is "all").
    tenant_max_full_runs: int | None = None
    # Who may start a full-parameter run (rank 0: engine/full_param.py, a lane of its own):
    # "all" tenants, "marked" ones only (a max_full_runs set for them: `twinkled ctl
    # tenants set NAME --max-full-runs N` or [tenants.NAME]), or "none".
    full_runs: str = "all"
    # On a daemon of one lane, a full run may take that lane while no LoRA run is there
    # (live, queued or parked); while it lives, LoRA runs and base-model samples are refused
    # (a 400 naming its tenant) and resume once it ends. false: full runs need --lanes 2+.
    full_run_only_lane: bool = False
    # Bytes of a tenant's adapters in one lane's GPU bank at once (None: no cap): beyond it
    # its own least recently used idle adapters are parked (core/residency.py).
    tenant_max_resident_bytes: int | None = None
    # Checkpoint files + stored user_metadata per tenant (50 GiB); 0 or less: unlimited.
    tenant_max_storage_bytes: int = 50 * 1024**3
    # Open sessions per tenant (not finished, heartbeated in the last 10 minutes); 0: no cap.
    tenant_max_sessions: int = 256
    # Per-tenant settings: {"alice": {"weight": 2, "max_queued_requests": 64}, ...}
    tenants: dict = field(default_factory=dict)
    # Limits on one request, checked at the door before it is queued (docs/reference.md).
    max_datums: int = 4096  # datums in one forward_backward request
    max_num_samples: int = 256  # num_samples of one sampling request
    max_stop: int = 32  # stop strings in a sampling stop list
    max_stop_ids: int = 1024  # stop token ids in a sampling stop list
    max_topk: int = 64  # k of top-k logprobs and of prompt_alt_tokens_k
    max_prompt_cells: int = 1 << 21  # prompt positions x ids scored (top-k, targets, draws)
    max_name_chars: int = 128  # checkpoint names
    max_ttl_s: int = 315360000  # checkpoint ttl_seconds (10 years)
    max_metadata_bytes: int = 65536  # user_metadata as JSON
    max_body_bytes: int = 64 * 2**20  # a request body, after decompression
    # Images (vision-language models; protocol/images.py), checked at the door.
    image_max_bytes: int = 20 * 2**20  # one image's encoded bytes
    image_max_pixels: int = 40_000_000  # one image's width x height (read from its header)
    image_max_tokens: int = 16384  # one image's placeholder tokens
    request_max_image_tokens: int = 65536  # all images' placeholder tokens in one request
    image_dir: str = ""  # ImageAssetPointerChunk file:// paths must lie under it; "": refused
    # Sampled sequences recorded for stable_reinforce (record_stability_info), in memory.
    stability_bytes: int = 256 * 2**20  # all tenants together
    stability_tenant_bytes: int = 64 * 2**20  # one tenant
    log_format: str = "text"  # text | json: one log line per request (json for log shippers)
    log_summary_s: float = 60.0  # a summary line (tok/s, steps, queued) this often; 0: none
    # OpenTelemetry traces of requests (the `otel` extra; core/otel.py); OTEL_TRACES_EXPORTER
    # turns them on too, and the OTEL_EXPORTER_OTLP_* variables say where they go.
    otel: bool = False
    admin_key_file: str = ""  # "": <data_dir>/admin.key, made at the first start (mode 0600)
    # Worker ranks on other hosts (`twinkled worker --join`): where they join ("": none).
    join_listen: str = ""  # tcp://ADDRESS:PORT, e.g. tcp://0.0.0.0:7070
    join_token_file: str = ""  # "": <data_dir>/join.key, made at the first start (0600)
    remote_ranks: int = 0  # remote ranks each (re)start waits for, up to join_timeout_s
    join_timeout_s: float = 60.0
    join_heartbeat_s: float = 10.0  # a host that sends nothing for this long is lost

    def resident_cap(self, tenant: str) -> int | None:
        """The bytes of `tenant`'s adapters one lane's GPU bank holds at once
        ([tenants.NAME] max_resident_bytes, else tenant_max_resident_bytes); None: no cap."""
        value = (self.tenants.get(tenant) or {}).get("max_resident_bytes")
        return value or self.tenant_max_resident_bytes or None

    def storage_quota_default(self, tenant: str) -> int | None:
        """The tenant's storage quota by this config ([tenants.NAME] max_storage_bytes, else
        tenant_max_storage_bytes), None for no limit; `ctl tenants set` wins over it
        (store.checkpoints.storage_quota)."""
        value = (self.tenants.get(tenant) or {}).get("max_storage_bytes")
        value = value or self.tenant_max_storage_bytes
        return value if value and value > 0 else None

    @cached_property
    def model_config(self) -> dict:
        """The model directory's config.json (read once; {} if unreadable). A multimodal
        checkpoint's text model (Qwen3.5: `text_config`) lifted to the top: its sizes are
        the ones the engine runs."""
        try:
            data = json.loads((self.model / "config.json").read_text())
        except (OSError, TypeError, ValueError):
            return {}
        text = data.get("text_config") if isinstance(data, dict) else None
        return {**data, **text} if isinstance(text, dict) else data

    def request_limits(self, model: dict) -> RequestLimits:
        """The limits one request is held to, given the model's numbers (vocab_size and
        max_seq_len, or config.json's max_position_embeddings)."""
        return RequestLimits(
            vocab_size=int(model.get("vocab_size") or 0),
            max_seq_len=int(model.get("max_seq_len") or model.get("max_position_embeddings")
                            or 0),
            max_rank=self.max_rank, max_datums=self.max_datums,
            max_num_samples=self.max_num_samples, max_stop=self.max_stop,
            max_stop_ids=self.max_stop_ids,
            max_topk=self.max_topk, max_prompt_cells=self.max_prompt_cells,
            max_name_chars=self.max_name_chars, max_ttl_s=self.max_ttl_s,
            max_metadata_bytes=self.max_metadata_bytes, kv_tokens=int(model.get("kv_tokens") or 0))

    @property
    def preempt_s(self) -> float | None:
        """`preempt_ms` for the planner: None for "auto", 0.0 for off, else seconds."""
        return None if self.preempt_ms == "auto" else self.preempt_ms / 1000

    @property
    def target_step_s(self) -> float | None:
        """`target_step_ms` for the planner: None for "auto", 0.0 for off, else seconds."""
        if self.target_step_ms == "auto":
            return None
        if isinstance(self.target_step_ms, str) or self.target_step_ms < 0:
            raise ValueError(f"target_step_ms must be \"auto\" or a number of ms >= 0 "
                             f"(0: no time bound), got {self.target_step_ms!r}")
        return self.target_step_ms / 1000

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

    def range_problems(self) -> list[str]:
        """The settled values (file and command-line flags together) against the ranges
        `check_config` holds a file to: `twinkled serve --tp 0` is refused by name too."""
        problems = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in RANGES or value is None or isinstance(value, Path):
                continue
            ok, why = RANGES[f.name]
            if not ok(value):
                problems.append(f"{f.name}: {why}, got {value!r}")
        return problems

    def lane_devices(self) -> list[list[str]]:
        """The worker devices of each lane: `lanes` consecutive, equal slices."""
        if self.lanes == 0:  # no workers here: lanes come from other hosts (remote_lanes.py)
            return []
        devices = self.worker_devices()
        n = max(1, len(devices) // self.lanes)
        return [devices[i:i + n] for i in range(0, len(devices), n)]


@cache  # a subprocess importing torch: once per process, whoever asks
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


# -- `twinkled config check` ------------------------------------------------------------

_TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
               list: "an array", dict: "a table"}


def check_config(path: str | Path) -> list[str]:
    """Check a `twinkled` TOML config file without starting anything.

    Returns the problems found, one human-readable line each, in file order; an empty list
    means the file is fine and `Config.load` accepts it. Each line starts with the dotted
    key it is about (`port: ...`, `tenants.alice.weight: ...`), except a read or TOML syntax
    error, which is the only problem reported then (TOML's message carries the line and
    column). Checked: unknown keys (with the closest known key as a suggestion), value types
    (against the `Config` dataclass), and ranges (ports, positive budgets and ranks,
    non-negative timeouts, dtype, device names, log_format, the `tenants` tables). Never
    raises for what is in the file; only the file is checked, not command-line flags.
    """
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as e:
        return [f"cannot read {path}: {e.strerror or e}"]
    except UnicodeDecodeError as e:
        return [f"{path} is not UTF-8 text: {e}"]
    except tomllib.TOMLDecodeError as e:
        return [f"TOML syntax error in {path}: {e}"]
    hints = typing.get_type_hints(Config)
    problems: list[str] = []
    for key, value in raw.items():
        if key not in hints:
            problems.append(_unknown(key, hints))
        elif (wrong := _wrong_type(key, value, hints[key])) is not None:
            problems.append(wrong)
        elif key == "devices":
            problems += _check_devices(value)
        elif key == "tenants":
            for name, table in value.items():
                problems += _check_tenant(name, table, hints)
        elif key in RANGES and not RANGES[key][0](value):
            problems.append(f"{key}: {RANGES[key][1]}, got {value!r}")
    if raw.get("remote_ranks") and not raw.get("join_listen"):
        problems.append("remote_ranks: remote ranks need join_listen (where they join)")
    if raw.get("lanes") == 0 and not raw.get("join_listen"):
        problems.append("lanes: 0 (no workers here) needs join_listen: the lanes come from "
                        "the hosts that join")
    return problems


def _unknown(key: str, known, where: str = "") -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
    return f"{where}{key}: unknown key; {hint}"


def _wrong_type(key: str, value, hint) -> str | None:
    """`key: must be <type>, got <type> ...` when value does not fit the annotation."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for t in options:
        origin = typing.get_origin(t) or t
        if t is type(None) or isinstance(value, bool) != (t is bool):
            continue
        if ((t in (str, Path) and isinstance(value, str)) or (t is bool)
                or (t is int and isinstance(value, int))
                or (t is float and isinstance(value, int | float))
                or (origin is dict and isinstance(value, dict))):
            return None
        if origin is list and isinstance(value, list):
            bad = [v for v in value if not isinstance(v, str)]  # list[str] is the only list
            if not bad:
                return None
            return f"{key}: must be an array of strings, got {bad[0]!r} in it"
    want = {str: "a string", Path: "a string (a path)", int: "an integer", float: "a number",
            bool: "true or false", dict: "a table", list: "an array of strings"}
    names = [want.get(typing.get_origin(t) or t, str(t)) for t in options
             if t is not type(None)]
    got = _TOML_TYPES.get(type(value), type(value).__name__)
    return f"{key}: must be {' or '.join(names)}, got {got} {value!r}"


def _check_devices(devices: list[str]) -> list[str]:
    problems = [f"devices: {d!r} is not cpu, cuda or cuda:N" for d in devices
                if not DEVICE.fullmatch(d)]
    gpus = [d for d in devices if d.startswith("cuda")]
    if len(set(gpus)) < len(gpus):
        problems.append(f"devices: a GPU is listed twice in {devices} (one worker per GPU)")
    return problems


def _check_tenant(name: str, table, hints) -> list[str]:
    where = f"tenants.{name}"
    if not isinstance(table, dict):
        return [f"{where}: must be a table ([{where}] with weight and quotas), "
                f"got {_TOML_TYPES.get(type(table), type(table).__name__)} {table!r}"]
    problems = []
    for key, value in table.items():
        if key.startswith("tenant_") and key.removeprefix("tenant_") in TENANT_KEYS:
            problems.append(f"{where}.{key}: unknown key; in a tenant's table it is "
                            f"{key.removeprefix('tenant_')!r}, without the tenant_ prefix")
        elif key not in TENANT_KEYS and key in hints:
            problems.append(f"{where}.{key}: unknown key; {key!r} is a top-level key: put it "
                            f"before the first [table] of the file")
        elif key not in TENANT_KEYS:
            problems.append(_unknown(key, TENANT_KEYS, where + "."))
        elif (wrong := _wrong_type(f"{where}.{key}", value,
                                   float if key == "weight" else int)) is not None:
            problems.append(wrong)
        elif not RANGES[key][0](value):
            problems.append(f"{where}.{key}: {RANGES[key][1]}, got {value!r}")
    return problems
