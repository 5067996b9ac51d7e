"""Shared fixtures: tiny models built offline once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread per process: the suite runs several test processes (pytest-xdist), each
# with daemons and workers, on a box of few cores, and torch's spinning thread pools starve
# each other when they oversubscribe the cores (measured: a cookbook script 2 min 12 s with
# its default threads beside other jobs, 38 s with one). Workers take it too (executor.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton's interpreter, so the kernel tests run the GPU kernels' code on CPU (it must be set
# before triton is first imported). Nothing takes a kernel path on CPU unless asked.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny Qwen3 model (the default architecture) and its tokenizer."""
    from twinkled.engine.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen3")


@pytest.fixture(scope="session")
def arch_dirs(tmp_path_factory):
    from twinkled.engine.tiny import build_tiny_model

    return {a: build_tiny_model(tmp_path_factory.mktemp(a) / f"tiny-{a}", arch=a)
            for a in ("qwen2", "qwen3", "llama")}


@pytest.fixture()
def engine(tiny_dir):
    from helpers import make_engine

    return make_engine(tiny_dir)


@pytest.fixture(scope="session")
def daemon(tiny_dir, tmp_path_factory):
    """A real `twinkled serve` on the tiny model, with keys for tenants alice and bob."""
    from daemon import Daemon, make_key

    data = tmp_path_factory.mktemp("data")
    cfg = data / "twinkled.toml"
    # A 5-datum call arrives in 3 chunks; a poll is held 2 s before try_again; steps hold
    # 24 tokens, so the scheduler cuts multi-datum requests into pieces. At the end, work
    # tests left queued (a paused tenant's) is failed after 1 s, not drained for 60 (the
    # stop's 30 s grace ran out at the end of every test process that used this daemon).
    cfg.write_text("fwdbwd_max_chunk_len = 2\npoll_seconds = 2.0\ntoken_budget = 24\n"
                   "drain_timeout_s = 1\n")
    d = Daemon(tiny_dir, data, data / "twinkled.log", "--config", str(cfg))
    d.keys = {t: make_key(data, t) for t in ("alice", "bob")}
    d.data = data
    yield d
    d.stop()


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (8 experts, top-2, every layer sparse) and its tokenizer."""
    from twinkled.engine.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe", arch="qwen3_moe")
