"""Lanes on every host (issue 39 item 1): hosts that join with `twinkled worker --join
--lanes N` bring lanes the head places runs on like its own; a lost host costs only its
lanes' steps in flight, its runs coming back on other lanes at their acknowledged steps;
a host that returns takes new work. A head without workers of its own (`lanes = 0`) and
two agents, of two CPU lanes and of one. Where the machine allows it (root, iproute2, a
bridge that carries TCP: tests/netns.py), each agent runs in a network namespace of its
own and reaches the head over a veth pair, and the lost host's namespace is deleted with
it; elsewhere the agents join over loopback (TWINKLE_NETNS=0 forces that)."""

from __future__ import annotations

import os
import socket
import time
import urllib.request
import warnings
from pathlib import Path

import pytest
from daemon import Daemon, ctl_status, free_port, make_key
from netns import HEAD_IP, wire
from test_hosts import TOKEN, Agent
from test_workers import T, _data, _step

tinker = pytest.importorskip("tinker")


def wait_lanes(data_dir: Path, want: list[tuple[str, bool | None]],
               timeout: float = 90) -> list:
    """Until `ctl status` shows lanes on these hosts, each up (True), down (False) or
    either (None)."""
    deadline = time.time() + timeout
    lanes = None
    while time.time() < deadline:
        lanes = ctl_status(data_dir).get("lanes") or []
        if [lane["host"] for lane in lanes] == [h for h, _ in want] and all(
                up is None or (lane["down"] is None) == up
                for lane, (_, up) in zip(lanes, want, strict=True)):
            return lanes
        time.sleep(0.3)
    raise TimeoutError(f"lanes are not {want}: {lanes}")


def head_config(path: Path, token: Path, port: int, host: str = "127.0.0.1",
                lanes: int = 1) -> Path:
    # (a heartbeat of 2-3 s was seen to lose a live host starved of CPU by the suite)
    path.write_text(f'join_listen = "tcp://{host}:{port}"\njoin_token_file = "{token}"\n'
                    f"join_heartbeat_s = 5\nworker_threads = 1\nlanes = {lanes}\n")
    return path


def client(d, tenant: str, tiny_dir: Path, seed: int):
    sc = tinker.ServiceClient(base_url=d.url, api_key=d.keys[tenant])
    return sc.create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                          seed=seed).result(timeout=T)


def lane_of(data_dir: Path) -> list[int]:
    """The runs open on each lane."""
    return [lane["adapters"] for lane in ctl_status(data_dir)["lanes"]]


def lose_a_host_mid_step(d, tiny_dir: Path, lanes: list[tuple[str, bool]], kill) -> None:
    """The scenario both this file and test_cluster_netns run, on `lanes` (each lane's host
    and whether it takes work: all up but the head's in a head without workers): three
    runs, each on a lane of its own (the fewest runs first) with the same seed and data:
    the control on the first, bob's next (on hosta), carol's on the last (hostb). hostb
    is lost (`kill()`) while bob's and carol's runs are mid-step. bob sees no error;
    carol's run comes back on another lane at its acknowledged step: all three train the
    same losses, step for step (fp32)."""
    ctl, bob, carol = (client(d, t, tiny_dir, 7) for t in ("alice", "bob", "carol"))
    up = [i for i, (_, on) in enumerate(lanes) if on]
    assert [lane_of(d.data_dir)[i] for i in up] == [1] * 3  # one run on each lane
    data = _data(ctl.get_tokenizer())
    want = [_step(ctl, data).metrics["loss:sum"] for _ in range(3)]  # the control, at home
    got = {"bob": [_step(bob, data).metrics["loss:sum"]],
           "carol": [_step(carol, data).metrics["loss:sum"]]}

    fb = {name: tc.forward_backward(data, "cross_entropy") for name, tc in
          (("bob", bob), ("carol", carol))}
    opt = {name: tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2))
           for name, tc in (("bob", bob), ("carol", carol))}
    time.sleep(0.5)  # both remote lanes mid-step (their workers wait 1 s a step)
    kill()
    got["bob"].append(fb["bob"].result(timeout=T).metrics["loss:sum"])  # no error
    opt["bob"].result(timeout=T)
    with pytest.raises(tinker.RequestFailedError, match="restarted"):
        fb["carol"].result(timeout=T)
    with pytest.raises(tinker.RequestFailedError):
        opt["carol"].result(timeout=T)
    wait_lanes(d.data_dir, [(host, on and host != "hostb") for host, on in lanes])
    for _ in range(2):  # carol goes on at its acknowledged step: the lost one redone
        got["carol"].append(_step(carol, data).metrics["loss:sum"])
    got["bob"].append(_step(bob, data).metrics["loss:sum"])
    # carol's run is on a lane that is up now, not on the lost one
    runs = lane_of(d.data_dir)
    assert runs[up[-1]] == 0 and sum(runs) == 3
    for name in ("bob", "carol"):
        assert got[name] == pytest.approx(want, rel=1e-4), name
    assert want[-1] < want[0]  # it trained
    metrics = urllib.request.urlopen(f"{d.url}/metrics", timeout=10).read().decode()
    assert f'twinkle_worker_up{{device="cpu",host="hostb",lane="{up[-1]}",rank="0"}} 0.0' \
        in metrics


# The hosts' namespaces: hosta, hostb, and hostb when it returns (its first one deleted).
HOSTS = {"hosta": 0, "hostb": 1, "hostb-again": 2}


@pytest.fixture
def head(tiny_dir, tmp_path):
    """The head, and where its hosts' agents run (`d.net`: network namespaces, or None for
    loopback)."""
    net, why = wire(len(HOSTS)) if os.environ.get("TWINKLE_NETNS") != "0" else (None, "")
    if net is None and why:
        warnings.warn(f"hosts join over loopback: {why}", stacklevel=1)
    token = tmp_path / "join.key"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    port = free_port()
    cfg = head_config(tmp_path / "head.toml", token, port, HEAD_IP if net else "127.0.0.1",
                      lanes=0)  # no workers here
    data_dir = tmp_path / "head"
    data_dir.mkdir()
    d = Daemon(tiny_dir, data_dir, data_dir / "log", "--config", str(cfg),
               env={"GLOO_SOCKET_IFNAME": net.bridge} if net else None)
    d.keys = {t: make_key(data_dir, t) for t in ("alice", "bob", "carol", "dave")}
    d.join_port, d.token, d.agents, d.net = port, token, [], net
    try:
        yield d
    finally:
        d.stop()
        for agent in d.agents:
            agent.stop()
        if net is not None:
            net.remove()


def _agent(d, name: str, log: Path, lanes: int = 1, where: str = "") -> Agent:
    """Host `name`'s agent, in the namespace of `where` (default: its name) if any."""
    net = d.net
    agent = Agent(d.join_port, d.token, log, env={"TWINKLED_TEST_STEP_DELAY": "1.0"},
                  name=name, lanes=lanes, devices=",".join(["cpu"] * lanes),
                  head=HEAD_IP if net else "127.0.0.1",
                  prefix=net.prefix(HOSTS[where or name]) if net else ())
    d.agents.append(agent)
    return agent


def test_runs_on_lanes_of_two_hosts_and_a_lost_host_costs_only_its_steps(head, tiny_dir,
                                                                          tmp_path):
    """A head with no workers (lanes = 0): hosta brings two lanes, hostb one."""
    here = socket.gethostname()
    assert head.health()["status"] == "ok"  # up with no lane: work waits for one (503s)
    _agent(head, "hosta", tmp_path / "a.log", lanes=2)
    wait_lanes(head.data_dir, [(here, False), ("hosta", None), ("hosta", None)])
    hostb = _agent(head, "hostb", tmp_path / "b.log")
    lanes = [(here, False), ("hosta", True), ("hosta", True), ("hostb", True)]
    status = wait_lanes(head.data_dir, lanes)
    assert [lane["remote"] for lane in status] == [False, True, True, True]

    def kill() -> None:  # the host goes: its agent and its rank, then its network
        hostb.kill()
        if head.net is not None:
            head.net.delete(HOSTS["hostb"])

    lose_a_host_mid_step(head, tiny_dir, lanes, kill)
    assert head.health()["status"] == "ok"

    # hostb comes back: its lane restarts there and takes new work (the run placed next
    # goes to the lane with the fewest runs, or balance moves one there).
    _agent(head, "hostb", tmp_path / "b2.log", where="hostb-again")
    wait_lanes(head.data_dir, lanes)
    dave = client(head, "dave", tiny_dir, 3)
    assert lane_of(head.data_dir)[3] >= 1
    assert _step(dave, _data(dave.get_tokenizer())).metrics["loss:sum"] > 0
    # Sampling: from dave's weights (on his run's lane) and from the base model (any lane
    # that is up, in turn: never the head's, which has no workers).
    prompt = tinker.types.ModelInput.from_ints(dave.get_tokenizer()("a cat").input_ids)
    params = tinker.types.SamplingParams(max_tokens=3, temperature=0.0)
    sampler = dave.save_weights_and_get_sampling_client()
    sampler = sampler.result(timeout=T) if hasattr(sampler, "result") else sampler
    base = tinker.ServiceClient(base_url=head.url, api_key=head.keys["dave"]) \
        .create_sampling_client(base_model=tiny_dir.name)
    base = base.result(timeout=T) if hasattr(base, "result") else base
    for c in (sampler, base, base, base):
        assert len(c.sample(prompt, 1, params).result(timeout=T).sequences[0].tokens) == 3
