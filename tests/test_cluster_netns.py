"""Hosts on another network: `twinkled worker --join` agents each in its own network
namespace, reaching the head over a veth pair (10.77.0.0/24), not loopback. One trains
with the head's rank; removing its namespace mid-training (agent killed, `ip netns del`)
costs the step in flight, never the daemon: the run comes back at its acknowledged
weights and trains on. (Hosts that bring lanes, in namespaces where the machine allows
it: test_host_lanes.py, in make test.) Needs root, `ip netns` and TWINKLE_NETNS=1 (its
~25 s are over make test's budget): skipped, with the reason, elsewhere."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
from daemon import Daemon, free_port, make_key, stop_process
from netns import HEAD_IP, Namespaces, wire
from test_hosts import TOKEN, _wait_ranks
from test_workers import T, _data, _logprobs, _step

tinker = pytest.importorskip("tinker")


def _namespaces(count: int) -> Namespaces:
    if os.environ.get("TWINKLE_NETNS") != "1":  # ~25 s of a daemon and a host agent
        pytest.skip("a host in another network namespace: TWINKLE_NETNS=1 runs it (root)")
    wired, why = wire(count)
    if wired is None:
        pytest.skip(why)
    return wired


@pytest.fixture
def netns():
    """One namespace: yields (name, head-side bridge, host-side link)."""
    wired = _namespaces(1)
    ns, _, there = wired.hosts[0]
    try:
        yield ns, wired.bridge, there
    finally:
        wired.remove()


def test_a_host_in_another_namespace_trains_and_its_loss_costs_only_a_step(
        netns, tiny_dir, tmp_path):
    ns, here, there = netns
    token = tmp_path / "join.key"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    port = free_port()
    cfg = tmp_path / "head.toml"
    cfg.write_text(f'join_listen = "tcp://{HEAD_IP}:{port}"\njoin_token_file = "{token}"\n'
                   "remote_ranks = 1\njoin_timeout_s = 3\njoin_heartbeat_s = 3\n")
    data_dir = tmp_path / "head"
    data_dir.mkdir()
    key = make_key(data_dir, "alice")
    # gloo finds its interface by the host name, which names no address inside the
    # namespace: each side names the veth end it has (as operators set GLOO_SOCKET_IFNAME).
    d = Daemon(tiny_dir, data_dir, data_dir / "log", "--config", str(cfg), wait=False,
               env={"GLOO_SOCKET_IFNAME": here})
    log = open(tmp_path / "agent.log", "ab")  # noqa: SIM115 - closed below
    agent = subprocess.Popen(
        ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={there}", "HF_HUB_OFFLINE=1",
         sys.executable, "-m", "twinkled", "worker", "--join", f"tcp://{HEAD_IP}:{port}",
         "--devices", "cpu", "--token-file", str(token), "--name", "nshost"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        d.wait_ready()
        workers = _wait_ranks(data_dir, [socket.gethostname(),
                                         "nshost"])
        assert workers[1]["remote"]
        tc = tinker.ServiceClient(base_url=d.url, api_key=key).create_lora_training_client(
            base_model=tiny_dir.name, rank=4, seed=5).result(timeout=T)
        data = _data(tc.get_tokenizer())
        losses = [_step(tc, data).metrics["loss:sum"] for _ in range(2)]
        assert losses[1] < losses[0]  # trained across the two "hosts"
        want = _logprobs(tc, data)

        # The host goes: its agent (and with it its rank), then its whole network.
        fut = tc.forward_backward(data, "cross_entropy")
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
        subprocess.run(["ip", "netns", "del", ns], check=True, capture_output=True)
        try:
            fut.result(timeout=T)
        except tinker.RequestFailedError as e:
            assert "restarted" in str(e)
        _wait_ranks(data_dir, [socket.gethostname()])
        after = [x for row in _logprobs(tc, data) for x in row]
        assert after == pytest.approx([x for row in want for x in row], rel=1e-4, abs=1e-5)
        assert _step(tc, data).metrics["loss:sum"] > 0
        assert d.health()["status"] == "ok"
    finally:
        d.stop()
        if agent.poll() is None:
            stop_process(agent)
        log.close()
