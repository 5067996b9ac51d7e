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


def pytest_configure(config: pytest.Config) -> None:
    # In the processes that run tests: not in pytest-xdist's controller, which runs none
    # (importing the SDK, and torch with it, cost it ~3 s of CPU while its workers collect).
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        _track_tinker_clients()
        _start_zygote()


# -- one worker zygote a test process -------------------------------------------------------
# The suite's ~90 worker starts each imported torch and transformers' modeling code, ~5 s of
# CPU apiece: half of the suite's CPU. Every daemon a test starts forks its ranks from this
# process's zygote instead (TWINKLED_ZYGOTE, twinkled/workers/launch.py), the way a daemon
# forks them from its own; one started with other import-time settings starts its own.
def _start_zygote() -> None:
    import atexit
    import shutil
    import subprocess
    import sys
    import tempfile

    if os.environ.get("TWINKLED_ZYGOTE"):
        return
    where = tempfile.mkdtemp(prefix="twinkle-test-zygote-")
    atexit.register(shutil.rmtree, where, True)  # (the zygote dies with this process)
    path = os.path.join(where, "zygote.sock")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    subprocess.Popen([sys.executable, "-m", "twinkled.workers.zygote", path, "--parent",
                      str(os.getpid()), "--preload", "transformers.models.qwen3.modeling_qwen3"],
                     env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    os.environ["TWINKLED_ZYGOTE"] = path


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
# Seconds: each unit's wall in a full `make test` run (4 processes on a busy 2-core box,
# 2026-11-29); a unit not named here (all under ~15 s) runs after these, in collection
# order. Longest first: the last units to start are short, so the processes end together.
LONGEST_FIRST = [
    # (slow_pair, 2 ranks: the former test_workers.py group, test_durability.py's
    # data-parallel test and test_trace.py, on one daemon)
    "test_worker_pair.py",  # 215
    "test_newcomer.py",  # 190
    "test_hosts.py",  # 135: two_hosts' tests, and the tp test (both use one_rank)
    "test_chaos.py",  # 110
    "test_host_lanes.py",  # 110: a head and three host agents (lanes on every host)
    "test_isolation.py",  # 105
    "test_sdk_cookbook.py",  # 100 without the one below
    "test_fused_layer.py",  # 90 (liger's kernels in Triton's interpreter)
    "test_engine_tp.py",  # 70
    "test_engine_kernels.py",  # 70
    "test_fuzz.py",  # 65
    "test_tinker_restart.py::test_restart_keeps_runs_and_checkpoints",  # 60 (Dimuon's too)
    "test_durability.py",  # 60: the tests that share the module's `faulty` daemon
    "test_full_param_daemon.py",  # 55
    # (SIGINT and SIGTERM on one lineage: 3 daemon starts, not 4)
    "test_operator_stop.py::test_a_signal_to_the_process_group_stops_cleanly",  # 50
    "test_sample_slices.py",  # 50
    # (a worker kill, then a daemon SIGKILL: the former 33 s and 20 s tests, one daemon)
    "test_durability.py::test_worker_kill_and_daemon_sigkill_keep_every_acknowledged_step",
    # (the idle-unload test's daemon is this lineage's last: one start less)
    "test_workers.py::test_sigterm_is_a_hot_restart_and_sigkill_rolls_back_to_persisted_state",  # 45
    "test_qwen35_e2e.py",  # 45
    "test_tinker_moe.py",  # 40
    "test_gpt_oss_e2e.py",  # 40
    "test_lora_kernels.py",  # 35
    "test_workers.py::test_a_killed_lane_costs_only_its_own_tenants",  # 35
    "test_durability.py::test_a_hung_step_restarts_the_group_keeping_loads_and_saying_what_was_lost",
    "test_sdk_cookbook.py::test_two_gloo_ranks_train_what_one_process_does",  # 35
    "test_tinker_versions.py",  # 35: seven tinker SDKs, a process each
    "test_daemon_scheduling.py",  # 35
    "test_tinker_retries.py",  # 35 without the one below
    "test_full_param_dp.py",  # 30: two gloo ranks against one
    "test_cookbook_rl.py",  # 30
    "test_qwen35_moe_e2e.py",  # 30
    "test_residency_tiers.py",  # 30
    "test_vlm.py",  # 30
    "test_cp.py",  # 28
    "test_durability.py::test_with_persistence_off_a_worker_kill_brings_an_adapter_back_as_created",
    "test_tinker_tp.py",  # 26
    "test_vlm_e2e.py",  # 26
    "test_long_lane_daemon.py",  # 24: two lanes, a long run kept apart
    "test_admin.py",  # 23 without the two of its own
    "test_tinker_retries.py::test_after_a_crash_retried_steps_and_saves_and_idle_unloaded_runs_resume",  # noqa: E501
    "test_ckpt_store.py",  # 19
    "test_tinker_e2e.py",  # 18
    "test_openai_e2e.py",  # 17
    "test_hygiene.py",  # 16 without the one below
    "test_operator_logs.py",  # 15
    "test_daemon_health.py::test_a_model_that_fails_to_load_is_reported_not_fatal",  # 12
    "test_hygiene.py::test_ctl_tenants_list_shows_storage_without_a_daemon",
    "test_tinker_exports.py",
    "test_tinker_records.py",
    "test_engine_state.py",
    "test_limits.py",
    "test_service.py",
    "test_dp_reduce.py",
]
SPREAD = {"test_workers.py", "test_hosts.py", "test_durability.py", "test_admin.py",
          "test_tinker_dimuon.py", "test_tinker_retries.py", "test_tinker_restart.py",
          "test_operator_stop.py", "test_daemon_health.py", "test_sdk_cookbook.py",
          "test_hygiene.py"}
_SHARED_SCOPES = {"module", "class", "package"}
# Module fixtures every test has (autouse, above) that share no state between a file's
# tests: each process that runs some of a file's tests runs its own. Counted as shared,
# they had made every test of SPREAD part of its file's unit (measured: test_durability's
# units one after another in one process, 166 s; test_workers' two long tests last).
_PER_PROCESS = {"_close_tinker_clients"}


def _unit(item: pytest.Item) -> str:
    """The name of the unit `item` runs in: its file, or in SPREAD its own name when it
    shares no module fixture (nor the session's daemon) with its file's other tests."""
    name = item.path.name
    if name in SPREAD:
        defs = getattr(item, "_fixtureinfo", None)
        scopes = {d[-1].scope for n, d in defs.name2fixturedefs.items()
                  if n not in _PER_PROCESS} if defs else {"module"}
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
