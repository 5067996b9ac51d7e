"""What each config value must satisfy beyond its type (config.py's `Config` holds the keys
and their types; `check_config` and `Config.validate` apply these rules)."""

from __future__ import annotations

import re

from twinkled.protocol.rope import RULE, rope_scaling_ok

# a [tenants.NAME] table: weight, and the tenant_ quotas unprefixed
TENANT_KEYS = ("weight", "max_queued_requests", "max_queued_tokens", "max_adapters",
               "max_rank", "max_storage_bytes", "max_full_runs", "max_resident_bytes")
DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_ENDPOINT = re.compile(r"tcp://(\*|[\w.-]+):(\d{1,5})")
_STORE = re.compile(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^/]+)*/?")  # S3's bucket names
_URL = re.compile(r"https?://[^\s/]+(/\S*)?")


def _fused_spec(v) -> bool:
    levers = {"norm", "rope", "silu", "gemm", "prep"}
    return isinstance(v, str) and (v in ("all", "none") or (
        bool(v) and set(v.split(",")) <= levers))


_POSITIVE = (lambda v: v > 0, "must be positive")
_NON_NEGATIVE = (lambda v: v >= 0, "must be 0 or more")
_NOT_EMPTY = (lambda v: v != "", "must not be empty")
_QUOTA = (lambda v: v > 0, "must be a positive integer (leave the key out for no limit)")
# What a value of the right type must also satisfy: key -> (test, what is wrong otherwise).
RANGES = {
    "model": _NOT_EMPTY, "model_name": _NOT_EMPTY, "data_dir": _NOT_EMPTY, "host": _NOT_EMPTY,
    "port": (lambda v: 1 <= v <= 65535, "must be from 1 to 65535"),
    "dtype": (lambda v: v in ("bfloat16", "float32", "float16"),
              "must be bfloat16, float32 or float16"),
    "device": (lambda v: v == "auto" or DEVICE.fullmatch(v),
               "must be cpu, cuda, cuda:N or auto"),
    "workers": _POSITIVE, "tp": _POSITIVE, "lanes": _NON_NEGATIVE, "ep": _POSITIVE, "cp": _POSITIVE,
    "cp_min_tokens": _POSITIVE, "max_seq_len": _NON_NEGATIVE, "long_row_tokens": _NON_NEGATIVE,
    "rope_scaling": (rope_scaling_ok, RULE),
    "activation_checkpointing": (lambda v: v in ("auto", "on", "off"),
                                 "must be auto, on or off"),
    "worker_threads": _NON_NEGATIVE, "persist_every": _NON_NEGATIVE,
    "step_timeout_s": _POSITIVE, "drain_timeout_s": _NON_NEGATIVE, "max_rank": _POSITIVE,
    "token_budget": _POSITIVE, "shared_prefix": _NON_NEGATIVE,
    "fused_kernels": (_fused_spec,
                      "must be all, none or levers comma-separated of norm, rope, silu, gemm, prep"),
    "sample_kv_mb": _NON_NEGATIVE, "sample_rows": _POSITIVE,
    "sample_prefix_cache": (lambda v: 0 <= v <= 1, "must be from 0 to 1"),
    "logprob_gap_every": _NON_NEGATIVE, "adapter_memory_gb": _NON_NEGATIVE,
    "host_adapter_memory_gb": _NON_NEGATIVE, "fwdbwd_max_chunk_len": _POSITIVE,
    "sample_budget": _POSITIVE, "sample_slice_ms": _NON_NEGATIVE,
    "sample_long_slice_ms": _NON_NEGATIVE,
    "poll_seconds": (lambda v: 0 <= v < 45,
                     "must be from 0 to under 45 (the tinker client gives up a poll at 45 s)"),
    "gather_ms": _NON_NEGATIVE, "stability_bytes": _NON_NEGATIVE,
    "stability_tenant_bytes": _NON_NEGATIVE,
    "target_step_ms": (lambda v: v == "auto" or (not isinstance(v, str) and v >= 0),
                       'must be "auto" or a number of ms >= 0 (0: no time bound)'),
    "preempt_ms": (lambda v: v == "auto" or (not isinstance(v, str) and v >= 0),
                   'must be "auto" or a number of ms >= 0 (0: steps are not preemptible)'),
    "log_format": (lambda v: v in ("text", "json"), "must be text or json"),
    "full_runs": (lambda v: v in ("all", "marked", "none"), "must be all, marked or none"),
    "log_summary_s": _NON_NEGATIVE,
    "image_max_bytes": _POSITIVE, "image_max_pixels": _POSITIVE, "image_max_tokens": _POSITIVE,
    "request_max_image_tokens": _POSITIVE,
    "join_listen": (lambda v: v == "" or _ENDPOINT.fullmatch(v),
                    'must be "" or tcp://ADDRESS:PORT (e.g. tcp://0.0.0.0:7070)'),
    "checkpoint_store": (lambda v: v == "" or v.startswith("/") or _STORE.fullmatch(v),
                         'must be "", an absolute path or s3://BUCKET[/PREFIX]'),
    "checkpoint_store_endpoint": (lambda v: v == "" or _URL.fullmatch(v),
                                  'must be "" or an http(s):// URL'),
    "remote_ranks": _NON_NEGATIVE, "join_timeout_s": _NON_NEGATIVE,
    "join_heartbeat_s": (lambda v: v >= 1, "must be 1 s or more"),
    "weight": (lambda v: v > 0, "must be a positive number"),
    **{f"tenant_{k}": _QUOTA for k in TENANT_KEYS[1:]}, **{k: _QUOTA for k in TENANT_KEYS[1:]},
    "tenant_max_storage_bytes": (lambda v: True, ""),  # 0 or less: unlimited
    "tenant_max_sessions": _NON_NEGATIVE,
    "max_storage_bytes": (lambda v: v != 0, "must be a number of bytes, or -1 for no limit "
                          "(leave the key out for tenant_max_storage_bytes)"),
}
