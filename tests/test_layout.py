"""Worker layouts refused at start-up, before any worker loads anything (twinkled/server/layout.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from twinkled.protocol.config import Config
from twinkled.server.layout import expand_devices, layout_problems

QWEN3_32B = {"model_type": "qwen3", "hidden_size": 5120, "num_attention_heads": 64,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 25600,
             "num_hidden_layers": 64, "vocab_size": 151936, "tie_word_embeddings": False}
H100 = 80 * 10**9


def _config(tmp_path, model: dict, **kw) -> Config:
    (tmp_path / "config.json").write_text(json.dumps(model))
    return Config(model=tmp_path, data_dir=tmp_path / "data", **kw)


def test_device_ranges_expand():
    assert expand_devices("cuda:0-3") == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert expand_devices("cpu,cpu") == ["cpu", "cpu"]


def test_tp_must_divide_devices_and_heads(tmp_path):
    cfg = _config(tmp_path, {**QWEN3_32B, "num_attention_heads": 6}, devices=["cpu"] * 4, tp=4)
    assert layout_problems(cfg) == ["tp: tp 4 does not divide the model's 6 attention heads"]
    cfg = _config(tmp_path, {**QWEN3_32B, "num_key_value_heads": 3}, devices=["cpu"] * 4, tp=4)
    assert layout_problems(cfg) == ["tp: tp 4 and the model's 3 KV heads: one must divide "
                                    "the other"]
    cfg = _config(tmp_path, QWEN3_32B, devices=["cpu"] * 3, tp=2)
    assert layout_problems(cfg) == ["tp: 2 does not divide the 3 worker devices "
                                    "['cpu', 'cpu', 'cpu']"]
    # Across hosts, each host brings whole tensor-parallel groups.
    cfg = _config(tmp_path, QWEN3_32B, devices=["cpu"] * 3, tp=2, join_listen="tcp://*:7070",
                  remote_ranks=1)
    assert layout_problems(cfg) == ["tp: each host's ranks must make whole groups of 2: "
                                    "this host has 3, remote_ranks is 1"]


def test_more_gpus_than_present(tmp_path):
    cfg = _config(tmp_path, QWEN3_32B, devices=["cuda:0", "cuda:1"], tp=2)
    assert layout_problems(cfg, gpu_memory=[H100]) == [
        "devices: cuda:1 is not here (1 CUDA device(s) present)"]


def test_a_model_that_does_not_fit_is_refused_with_the_tp_that_would(tmp_path):
    cfg = _config(tmp_path, QWEN3_32B, devices=["cuda:0", "cuda:1"], tp=1,
                  token_budget=4096)
    problems = layout_problems(cfg, gpu_memory=[H100, H100])
    assert len(problems) == 1 and "--tp 2 would fit" in problems[0], problems
    assert layout_problems(replace(cfg, tp=2), gpu_memory=[H100, H100]) == []


def test_serve_refuses_a_bad_layout_at_start(tiny_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "twinkled", "serve", "--model", str(tiny_dir),
                          "--data-dir", str(tmp_path), "--devices", "cpu,cpu", "--tp", "4"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "tp: 4 does not divide the 2 worker devices" in out.stderr
    assert "tp 4 does not divide the model's 2 attention heads" in out.stderr


@pytest.mark.parametrize("flag, says", [
    (("--tp", "0"), "tp: must be positive, got 0"),
    (("--lanes", "0"), "lanes: 0 (no workers here) needs join_listen"),
    (("--port", "70000"), "port: must be from 1 to 65535, got 70000"),
])
def test_serve_names_a_flag_out_of_range(tiny_dir, tmp_path, flag, says):
    """Flags are held to the ranges a config file is (not a traceback: a division by 0)."""
    out = subprocess.run([sys.executable, "-m", "twinkled", "serve", "--model", str(tiny_dir),
                          "--data-dir", str(tmp_path), "--device", "cpu", *flag],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_adapter_budget_follows_the_card_and_the_split(tmp_path):
    """What adapters may take per rank: the card less the weights, a recomputed micro-batch
    and the sampler pool; more with a bigger split; no limit without GPUs. A rank-32
    adapter of the 32B shape takes ~3.2 GiB a rank at tp 2 (20 bytes a parameter)."""
    from twinkled.protocol.sizing import GiB, adapter_bytes
    from twinkled.server.layout import adapters_budget

    cfg = _config(tmp_path, QWEN3_32B, devices=["cuda:0", "cuda:1"], tp=2, token_budget=4096)
    two = adapters_budget(cfg, [H100, H100])
    assert 20 * GiB < two < 35 * GiB
    assert adapters_budget(replace(cfg, token_budget=16384), [H100, H100]) < two
    assert adapters_budget(replace(cfg, devices=["cuda:0"], tp=1), [H100]) == 0  # no room
    assert adapters_budget(replace(cfg, devices=["cpu", "cpu"]), []) is None
    one = adapter_bytes(QWEN3_32B, 32, tp=2)
    assert 2.9 * GiB < one < 3.5 * GiB
    assert adapter_bytes(QWEN3_32B, 16, tp=2) * 2 == one
    assert adapter_bytes(QWEN3_32B, 32, tp=1) > one  # the split parts halve under tp 2
    assert adapter_bytes(QWEN3_32B, 32, mlp=False, unembed=False, tp=2) < one / 2


def test_the_chunked_head_caps_the_logits_a_micro_batch_is_counted_for(tmp_path):
    """A LoRA pass at tp 1 runs the chunked head above FULL_LOGITS_MAX of logits (engine/
    chunked_logprobs.py), so the bank is not sized for [tokens, vocab]: gpt-oss-20b's
    16K-token micro-batch of its 201K vocabulary was counted at 26 GiB of logits and left
    room for 7 of 8 tenants' 6 GiB adapters. A full-parameter run's head keeps the whole
    logits, and a vocabulary split (tp > 1) does too: both still count every logit."""
    from twinkled.protocol.sizing import FULL_LOGITS_MAX, GiB, activation_bytes
    from twinkled.server.layout import adapters_budget, full_run_room

    big = {**QWEN3_32B, "vocab_size": 201_088}
    whole = activation_bytes(big, 2, 16384, recompute=True, chunked_head=False)
    capped = activation_bytes(big, 2, 16384, recompute=True)
    assert whole - capped == 8 * (16384 * 201_088 - FULL_LOGITS_MAX // 2)
    assert activation_bytes(big, 2, 1024, recompute=True) == activation_bytes(
        big, 2, 1024, recompute=True, chunked_head=False)  # (under the switch: whole)
    assert activation_bytes(big, 2, 16384, tp=2, chunked_head=True) == activation_bytes(
        big, 2, 16384, tp=2, chunked_head=False)
    cfg = _config(tmp_path, big, devices=["cuda:0"], token_budget=16384)
    card = 141 * GiB
    assert adapters_budget(cfg, [card]) - full_run_room(cfg, [card]) > 15 * GiB


def test_the_start_up_line_names_the_grouping_and_suggests_lanes_where_they_apply(tmp_path):
    """Four local GPUs as one data-parallel group: the log says so and names --lanes 4
    (the grouping that scales for many small tenants); not once lanes are set, not with a
    single device, and not with other hosts (lanes take none)."""
    from twinkled.server.layout import layout_summary

    cfg = _config(tmp_path, QWEN3_32B, devices=["cuda:0", "cuda:1", "cuda:2", "cuda:3"])
    line = layout_summary(cfg)
    assert "1 lane(s) of 4 worker rank(s) on cuda:0, cuda:1, cuda:2, cuda:3" in line
    assert "--lanes 4" in line
    assert "--lanes 2" in layout_summary(replace(cfg, tp=2))  # two replicas of 2 GPUs
    lanes = layout_summary(replace(cfg, lanes=4))
    assert lanes.startswith("4 lane(s) of 1 worker rank(s)") and "--lanes" not in lanes
    assert "--lanes" not in layout_summary(replace(cfg, devices=["cuda:0"]))
    hosts = layout_summary(replace(cfg, remote_ranks=2, join_listen="tcp://0.0.0.0:7070"))
    assert "2 remote rank(s)" in hosts and "--lanes" not in hosts


def test_cpu_workers_take_omp_num_threads_when_it_is_set(monkeypatch):
    from twinkled.core.make_executor import GPU_WORKER_THREADS, default_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads(["cpu", "cpu"]) == 3
    assert default_threads(["cuda:0"]) == GPU_WORKER_THREADS  # a GPU worker's host threads
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_threads(["cpu", "cpu"]) == max(1, (os.cpu_count() or 1) // 2)


def test_the_sampler_kv_pool_is_sized_from_the_card_unless_set(tmp_path):
    """`sample_kv_mb = 0` on GPUs: a share of what the card has after the weights and a
    micro-batch (a 4 GiB pool decodes only a few dozen long rows of a big model at once),
    never under 4 GiB, and counted before the adapters' budget; a set value is kept; CPUs
    keep the worker's own default (0)."""
    from twinkled.server.layout import KV_FLOOR_MB, adapters_budget, kv_pool_mb

    cfg = _config(tmp_path, QWEN3_32B, devices=["cuda:0", "cuda:1"], tp=2, token_budget=4096)
    auto = kv_pool_mb(cfg, [H100, H100])
    assert 4 * KV_FLOOR_MB > auto > KV_FLOOR_MB  # ~10 GiB of the ~40 left on each H100
    assert kv_pool_mb(cfg, [2 * H100, 2 * H100]) > 2 * auto  # a bigger card, a bigger pool
    assert kv_pool_mb(replace(cfg, devices=["cuda:0"], tp=1), [H100]) == KV_FLOOR_MB
    assert kv_pool_mb(replace(cfg, sample_kv_mb=1234), [H100, H100]) == 1234
    assert kv_pool_mb(replace(cfg, devices=["cpu", "cpu"]), []) == 0
    sized = replace(cfg, sample_kv_mb=auto)
    assert adapters_budget(sized, [H100, H100]) < adapters_budget(cfg, [H100, H100])
