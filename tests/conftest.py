"""Shared fixtures: tiny models built offline once per test session."""

from __future__ import annotations

import os
import weakref

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


os.environ.setdefault("TINKER_TELEMETRY", "0")


# -- tinker clients end with their module ---------------------------------------------------
# A tinker client keeps its session alive from a background loop (a heartbeat every 10 s,
# config refreshes) until it is closed, and the tests' clients are never closed: their
# daemon stops, and each client's loop goes on failing against a dead port for the rest of
# the test process, logging as it goes. Measured: 20 such clients cost 1.4 s of CPU every
# 40 s, and a test process makes hundreds over its run, so they ate a noticeable share of the
# suite's CPU. The SDK closes a client's loops in InternalClientHolder.close(), which nothing
# public reaches, so every holder made in a module is closed when the module's tests end
# (module fixtures first: this autouse fixture is set up before them, so torn down after).
_HOLDERS: weakref.WeakSet = weakref.WeakSet()


def _track_tinker_clients() -> None:
    try:
        from tinker.lib.internal_client_holder import InternalClientHolder
    except ImportError:  # pragma: no cover - tinker is a test dependency
        return
    made = InternalClientHolder.__init__

    def init(self, *args, **kwargs):
        made(self, *args, **kwargs)
        _HOLDERS.add(self)

    InternalClientHolder.__init__ = init


_track_tinker_clients()


@pytest.fixture(autouse=True, scope="module")
def _close_tinker_clients():
    yield
    for holder in list(_HOLDERS):
        # Session-less holders (RestClient(base_url, api_key)) are the SDK's process-wide
        # cache, shared with later modules, and run no heartbeat: left open.
        if getattr(holder, "_session_id", None) is not None:
            holder.close()
    _HOLDERS.clear()


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


# -- how `make test` spreads the suite over its processes ---------------------------------
# pytest-xdist, `--dist loadgroup --no-loadscope-reorder`: a file's tests go to one process
# together (the daemons a module shares start once), and the units are handed out in the
# order below, longest first. xdist's own order (most tests first) started the longest
# files last (test_newcomer.py, test_chaos.py: one test each), and the suite ended with one
# process running them while the others sat idle. In the files of SPREAD, a test that
# shares no module fixture is a unit of its own, so no one file is the suite's long pole.
# Seconds: each file alone in one process on a busy 2-core box (2026-11-27), less the ~8 s
# a process takes to start and collect; a unit not named here (all under ~15 s) runs
# after these, in collection order.
LONGEST_FIRST = [
    # (slow_pair, 2 ranks: the former test_workers.py group, test_durability.py's
    # data-parallel test and test_trace.py, on one daemon)
    "test_worker_pair.py",  # 130
    "test_newcomer.py",  # 97
    "test_isolation.py",  # 90
    "test_chaos.py",  # 86
    "test_hosts.py",  # 150 (its tp test shares the module's one-rank reference)
    "test_host_lanes.py",  # 70: a head and three host agents (lanes on every host)
    "test_sdk_cookbook.py",  # 85 without the one below
    "test_engine_tp.py",  # 63
    "test_tinker_tp.py",
    "test_engine_kernels.py",  # 50
    "test_daemon_scheduling.py",  # 50
    "test_workers.py::test_a_killed_lane_costs_only_its_own_tenants",  # 50
    "test_fuzz.py",  # 48
    # (the idle-unload test's daemon is this lineage's last: one start less)
    "test_workers.py::test_sigterm_is_a_hot_restart_and_sigkill_rolls_back_to_persisted_state",  # 45
    # (SIGINT and SIGTERM on one lineage: 3 daemon starts, not 4)
    "test_operator_stop.py::test_a_signal_to_the_process_group_stops_cleanly",  # 45
    "test_durability.py",  # 40: the tests that share the module's `faulty` daemon
    "test_fused_layer.py",  # 36 (liger's kernels in Triton's interpreter)
    "test_hygiene.py",  # 45 without the one below
    "test_openai_e2e.py",  # 40
    "test_tinker_moe.py",  # 40
    "test_cookbook_rl.py",  # 38
    "test_tinker_versions.py",  # 30: seven tinker SDKs, a process each
    "test_sdk_cookbook.py::test_two_gloo_ranks_train_what_one_process_does",  # 35
    # (a worker kill, then a daemon SIGKILL: the former 33 s and 20 s tests, one daemon)
    "test_durability.py::test_worker_kill_and_daemon_sigkill_keep_every_acknowledged_step",
    "test_lora_kernels.py",  # 30
    "test_admin.py",  # 30 without the ones below
    "test_durability.py::test_with_persistence_off_a_worker_kill_brings_an_adapter_back_as_created",
    "test_engine_state.py",  # 26
    "test_limits.py",  # 25
    "test_service.py",  # 25
    "test_daemon_health.py::test_a_model_that_fails_to_load_is_reported_not_fatal",  # 24
    "test_dp_reduce.py",  # 23
    "test_durability.py::test_a_hung_step_restarts_the_group_keeping_loads_and_saying_what_was_lost",
    "test_admin.py::test_status_of_a_stopped_daemon_is_its_last_one",  # 21
    "test_full_param_dp.py",  # 20: two gloo ranks against one
    "test_sample_slices.py",  # 20
    "test_tinker_exports.py",  # 20
    "test_hygiene.py::test_ctl_tenants_list_shows_storage_without_a_daemon",  # 19
    "test_tinker_records.py",  # 17
    "test_long_lane_daemon.py",  # 17: two lanes, a long run kept apart
    "test_tinker_restart.py::test_restart_keeps_runs_and_checkpoints",  # 33 (Dimuon's lineage too)
    "test_vlm_e2e.py",  # 30
    "test_tinker_retries.py::test_after_a_crash_retried_steps_and_saves_and_idle_unloaded_runs_resume",  # noqa: E501
    "test_ckpt_store.py",  # 20
    "test_operator_logs.py",  # 15
]
SPREAD = {"test_workers.py", "test_hosts.py", "test_durability.py", "test_admin.py",
          "test_tinker_dimuon.py", "test_tinker_retries.py", "test_tinker_restart.py",
          "test_operator_stop.py", "test_daemon_health.py", "test_sdk_cookbook.py",
          "test_hygiene.py"}
_SHARED_SCOPES = {"module", "class", "package"}


def _unit(item: pytest.Item) -> str:
    """The name of the unit `item` runs in: its file, or in SPREAD its own name when it
    shares no module fixture (nor the session's daemon) with its file's other tests."""
    name = item.path.name
    if name in SPREAD:
        defs = getattr(item, "_fixtureinfo", None)
        scopes = {d[-1].scope for d in defs.name2fixturedefs.values()} if defs else {"module"}
        if not scopes & _SHARED_SCOPES and "daemon" not in item.fixturenames:
            return f"{name}::{item.name}"
    return name


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    units = {item: _unit(item) for item in items}
    for item, unit in units.items():
        if unit == item.path.name:  # a test of its own is a unit of its own unmarked
            item.add_marker(pytest.mark.xdist_group(unit))
    items.sort(key=lambda item: rank.get(units[item], len(rank)))  # stable: files stay in order
