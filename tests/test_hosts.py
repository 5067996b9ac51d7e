"""A worker group that spans hosts: `twinkled worker --join` on loopback stands in for a
second machine (CPU, gloo). It trains like one host with as many ranks; a host lost
mid-training costs a step, never the daemon; a joiner without the token is turned away."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon import Daemon, ctl_status, free_port, make_key, stop_process
from helpers import checkpoint_tensors
from test_workers import T, _data, _logprobs, _step

tinker = pytest.importorskip("tinker")
TOKEN = "0123456789abcdef" * 4


class Agent:
    """`twinkled worker --join` in its own process group (its workers die with it)."""

    def __init__(self, port: int, token_file: Path, log: Path, env: dict | None = None,
                 devices: str = "cpu", name: str = "hostb", lanes: int = 0,
                 head: str = "127.0.0.1", prefix: list[str] = ()):
        """`prefix`: what runs it elsewhere (another network namespace: tests/netns.py)."""
        self.log = open(log, "ab")  # noqa: SIM115 - kept open for the process's life
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "twinkled", "worker", "--join",
             f"tcp://{head}:{port}", "--devices", devices, "--token-file", str(token_file),
             "--name", name, "--lanes", str(lanes)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, HF_HUB_OFFLINE="1", **(env or {})))

    def kill(self) -> None:
        """The host dies at once: the agent and its ranks (its process group)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            stop_process(self.proc)
        self.log.close()




def _wait_ranks(data_dir: Path, hosts: list[str], timeout: float = 90) -> list[dict]:
    """Until `twinkled ctl status` shows live ranks on exactly these hosts, in rank order."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        workers = ctl_status(data_dir)["workers"]
        if [w["host"] for w in workers] == hosts and all(w["alive"] for w in workers):
            return workers
        time.sleep(0.3)
    raise TimeoutError(f"ranks not on {hosts}: {workers}")


@pytest.fixture(scope="module")
def two_hosts(tiny_dir, tmp_path_factory):
    """A daemon with one local rank that waits for one remote rank, and the agent that
    brings it. Its step delay (agent's ranks only) leaves time to act mid-step."""
    import socket

    data_dir = tmp_path_factory.mktemp("head")
    token = data_dir.parent / "join.key"
    token.write_text(TOKEN + "\n")
    port = free_port()
    cfg = data_dir.parent / "head.toml"
    cfg.write_text(f'join_listen = "tcp://127.0.0.1:{port}"\njoin_token_file = "{token}"\n'
                   # heartbeat: a lost host is noticed after this long; 3 s was seen
                   # to lose a live host starved of CPU by the suite's other processes
                   f"remote_ranks = 1\njoin_timeout_s = 3\njoin_heartbeat_s = 8\n"
                   f"worker_threads = 1\n")
    key = make_key(data_dir, "alice")
    d = Daemon(tiny_dir, data_dir, data_dir / "log", "--config", str(cfg), wait=False)
    agent = Agent(port, token, data_dir / "agent.log")
    try:
        d.wait_ready()
        d.key, d.join_port, d.token, d.agent = key, port, token, agent
        d.here = socket.gethostname()
        yield d
    finally:
        d.stop()  # first: an agent stopping first would restart the group for nothing
        agent.stop()
        getattr(d, "agent", agent).stop()


def _train(url: str, key: str, tiny_dir: Path):
    tc = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(
        base_model=tiny_dir.name, rank=4, seed=7).result(timeout=T)
    data = _data(tc.get_tokenizer())
    losses = [_step(tc, data).metrics["loss:sum"] for _ in range(3)]
    return tc, data, losses


def _trained(url: str, key: str, tiny_dir: Path, data_dir: Path) -> tuple:
    """(losses, logprobs, checkpoint tensors) of three steps through the daemon at `url`."""
    tc, data, losses = _train(url, key, tiny_dir)
    path = tc.save_state("after3").result(timeout=T).path
    return losses, _logprobs(tc, data), checkpoint_tensors(data_dir, path)


@pytest.fixture(scope="module")
def one_rank(daemon, tiny_dir) -> tuple:
    """`_trained` on a daemon of one local rank (the session's: a daemon start less; its
    small token budget cuts the batch into several passes, which sum to the same
    gradients): what a group over hosts (data or tensor parallel) must train like, within
    float tolerance."""
    return _trained(daemon.url, daemon.keys["alice"], tiny_dir, daemon.data)


def _same_training(got: tuple, want: tuple) -> None:
    """(losses, logprobs, checkpoint tensors) of two runs agree, and the first trained."""
    assert got[0] == pytest.approx(want[0], rel=1e-4)
    assert got[0][-1] < got[0][0]  # it trained
    for a, b in zip(got[1], want[1], strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    assert got[2].keys() == want[2].keys()
    for k, v in want[2].items():
        assert got[2][k].float().sub(v.float()).abs().max() <= 1e-5 + 1e-4 * v.abs().max(), k


def test_two_hosts_train_like_one_host(two_hosts, tiny_dir, one_rank):
    workers = _wait_ranks(two_hosts.data_dir, [two_hosts.here, "hostb"])
    assert [w["remote"] for w in workers] == [False, True]
    got = _trained(two_hosts.url, two_hosts.key, tiny_dir, two_hosts.data_dir)
    _same_training(got, one_rank)


def test_tensor_parallel_groups_on_two_hosts_train_like_one_rank(tiny_dir, tmp_path, one_rank):
    """--tp 2 on two hosts of two ranks each: a host holds a whole tensor-parallel group
    (its collectives never cross hosts) and the hosts are data-parallel replicas. Training
    gives what one rank gives."""
    import socket

    pytest.importorskip("megatron.core")
    port, token = free_port(), tmp_path / "join.key"
    token.write_text(TOKEN + "\n")
    cfg = tmp_path / "head.toml"
    cfg.write_text(f'join_listen = "tcp://127.0.0.1:{port}"\njoin_token_file = "{token}"\n'
                   "remote_ranks = 2\njoin_timeout_s = 60\nworker_threads = 1\n")
    head = tmp_path / "head"
    head.mkdir()
    key = make_key(head, "alice")
    d = Daemon(tiny_dir, head, head / "log", "--devices", "cpu,cpu", "--tp", "2",
               "--config", str(cfg), wait=False)
    agent = Agent(port, token, tmp_path / "agent.log", devices="cpu,cpu")
    try:
        d.wait_ready()
        here = socket.gethostname()
        _wait_ranks(head, [here, here, "hostb", "hostb"])
        got = _trained(d.url, key, tiny_dir, head)
    finally:
        d.stop()
        agent.stop()
    _same_training(got, one_rank)


def test_a_joiner_without_the_token_is_refused(two_hosts, tmp_path):
    wrong = tmp_path / "wrong.key"
    wrong.write_text("f" * 64)
    intruder = Agent(two_hosts.join_port, wrong, tmp_path / "intruder.log")
    try:
        assert intruder.proc.wait(timeout=60) == 2  # refused: retrying cannot help
    finally:
        intruder.stop()
    assert "wrong join token" in (tmp_path / "intruder.log").read_text()
    # The group is as it was: nothing restarted, both ranks up.
    status = ctl_status(two_hosts.data_dir)
    assert status["restarts"] == 0
    assert [w["host"] for w in status["workers"]] == [two_hosts.here, "hostb"]


@pytest.mark.filterwarnings("ignore:DEPRECATED")  # load_state: the legacy path
def test_loads_and_samplers_reach_the_other_host(two_hosts, tiny_dir):
    """Ranks on another host cannot read the daemon's data dir: a checkpoint load and a
    sampler load come from rank 0, so both ranks hold the same weights."""
    d = two_hosts
    tc, data, _ = _train(d.url, d.key, tiny_dir)
    path = tc.save_state("mid").result(timeout=T).path
    want = _logprobs(tc, data)
    _step(tc, data)
    tc.load_state(path).result(timeout=T)
    got = _logprobs(tc, data)  # rows split over both ranks: each rank's copy is the saved one
    assert [x for r in got for x in r] == pytest.approx([x for r in want for x in r], abs=1e-5)

    sampler = tc.save_weights_and_get_sampling_client()
    sampler = sampler.result(timeout=T) if hasattr(sampler, "result") else sampler
    tok = tc.get_tokenizer()
    prompts = [tinker.types.ModelInput.from_ints(tok(t).input_ids) for t in ("a cat", "blue")]
    greedy = tinker.types.SamplingParams(max_tokens=4, temperature=0.0)
    # Two requests in one step: one runs on each rank.
    futs = [sampler.sample(p, 1, greedy) for p in prompts * 2]
    out = [f.result(timeout=T).sequences[0].tokens for f in futs]
    assert out[:2] == out[2:] and all(len(t) == 4 for t in out)
    # The remote rank did not read the daemon's disk: rank 0 sent the checkpoint's files,
    # and the sampler came from the device copy each rank made at the save.
    shared = (d.data_dir / "agent.log").read_text()
    assert re.search(r"file\(s\) of \S+/checkpoints/\S+/weights/mid from rank 0", shared)
    assert "sampler_weights" not in shared
    # Sampler weights whose device copy is gone (more saves than are kept) come from the
    # files, which rank 0 sends.
    from twinkled.workers.sampling import FRESH_SAMPLERS

    paths = [tc.save_weights_for_sampler(f"s{i}").result(timeout=T).path
             for i in range(FRESH_SAMPLERS + 1)]
    old = tinker.ServiceClient(base_url=d.url, api_key=d.key).create_sampling_client(
        model_path=paths[0])
    out = [f.result(timeout=T).sequences[0].tokens
           for f in [old.sample(p, 1, greedy) for p in prompts * 2]]
    assert out[:2] == out[2:]
    shared = (d.data_dir / "agent.log").read_text()
    assert re.search(r"file\(s\) of \S+/checkpoints/\S+/sampler_weights/s0 from rank 0",
                     shared)
    assert ctl_status(d.data_dir)["restarts"] == 0


def test_a_lost_host_costs_a_step_never_the_daemon(two_hosts, tiny_dir):
    d = two_hosts
    tc = tinker.ServiceClient(base_url=d.url, api_key=d.key).create_lora_training_client(
        base_model=tiny_dir.name, rank=4, seed=3).result(timeout=T)
    data = _data(tc.get_tokenizer())
    _step(tc, data)
    time.sleep(0.5)  # the write-behind persistence of that step
    want = _logprobs(tc, data)

    # The whole second "host" goes: its agent, and with it (PDEATHSIG) its rank.
    fut = tc.forward_backward(data, "cross_entropy")
    d.agent.proc.send_signal(signal.SIGKILL)
    d.agent.proc.wait()
    try:
        fut.result(timeout=T)  # done before the kill, or failed with the restart message
    except tinker.RequestFailedError as e:
        assert "restarted" in str(e)
    assert d.health()["status"] in ("ok", "restarting")
    _wait_ranks(d.data_dir, [d.here])  # after join_timeout_s, without the lost host

    # The adapter is back at its acknowledged weights (the lost forward_backward, had it
    # finished, changed none), and it trains on the host that is left.
    after = [x for row in _logprobs(tc, data) for x in row]
    assert after == pytest.approx([x for row in want for x in row], rel=1e-4, abs=1e-5)
    assert _step(tc, data).metrics["loss:sum"] > 0
    assert d.health()["status"] == "ok"

    # The host comes back: taken in between steps (the group restarts with it, every
    # adapter restored on both ranks), and training goes on across hosts.
    d.agent = Agent(d.join_port, d.token, d.data_dir / "agent2.log")
    _wait_ranks(d.data_dir, [d.here, "hostb"])
    assert _step(tc, data).metrics["loss:sum"] > 0


# -- fast checks: config keys, the unit, the agent's command line -------------------------


@pytest.mark.parametrize("text, says", [
    ('join_listen = "0.0.0.0:7070"', "join_listen: must be"),
    ('join_listen = "tcp://0.0.0.0"', "join_listen: must be"),
    ("remote_ranks = 2", "remote_ranks: remote ranks need join_listen"),
    ('join_listen = "tcp://*:7070"\nremote_ranks = -1', "remote_ranks: must be 0 or more"),
    ('join_listen = "tcp://*:7070"\njoin_heartbeat_s = 0.5', "join_heartbeat_s: must be"),
])
def test_join_keys_are_checked(tmp_path, text, says):
    from twinkled.protocol.config import check_config

    path = tmp_path / "t.toml"
    path.write_text(text + "\n")
    assert any(p.startswith(says) for p in check_config(path)), check_config(path)


def test_join_keys_that_are_fine(tmp_path):
    from twinkled.protocol.config import check_config

    path = tmp_path / "t.toml"
    path.write_text('join_listen = "tcp://10.0.0.1:7070"\nremote_ranks = 2\n'
                    'join_timeout_s = 30\njoin_heartbeat_s = 5\njoin_token_file = "/k"\n')
    assert check_config(path) == []


def test_agent_refuses_bad_arguments_and_short_tokens(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "twinkled", "worker", *args],
                              capture_output=True, text=True, timeout=60)

    short = tmp_path / "short.key"
    short.write_text("abc")
    out = run("--join", "tcp://127.0.0.1:1", "--devices", "gpu0", "--token-file", str(short))
    assert out.returncode == 2 and "--devices" in out.stderr
    out = run("--join", "127.0.0.1:1", "--devices", "cpu", "--token-file", str(short))
    assert out.returncode == 2 and "--join" in out.stderr
    out = run("--join", "tcp://127.0.0.1:1", "--devices", "cpu", "--token-file", str(short))
    assert out.returncode == 1 and "fewer than 16 bytes" in out.stderr


def test_worker_unit_runs_the_agent_and_does_not_retry_a_refused_token():
    unit = (Path(__file__).resolve().parent.parent / "ops" / "twinkled-worker.service")
    settings = dict(line.split("=", 1) for line in unit.read_text().splitlines()
                    if "=" in line and not line.startswith(("#", "[")))
    assert settings["ExecStart"].split()[1:4] == ["worker", "--join", "${TWINKLE_HEAD}"]
    assert settings["RestartPreventExitStatus"] == "2"  # host.REFUSED
    assert "PrivateDevices" not in settings and settings["User"] == "twinkle"


def test_a_head_with_lanes_takes_hosts_by_their_lanes_and_their_names(tmp_path):
    """The join port of a head that takes lanes only (several of its own, or none): a host
    without lanes is refused for good (it says how), one with lanes is taken in, and a
    second live host of the same name (its lanes go by name) is asked to come back later."""
    from test_join_port import _answer, _run

    from twinkled.workers.join import (
        ChallengeF,
        JoinHelloF,
        ProofF,
        RefusedF,
        WelcomeF,
        encoder,
        proof,
    )

    async def join(registry, sock, hello):
        await sock.send(encoder.encode(hello))
        got = await _answer(sock)
        if isinstance(got, ChallengeF):
            await sock.send(encoder.encode(ProofF(proof(registry.token, got.nonce))))
            got = await _answer(sock)
        return got

    async def scenario(registry, dealer):
        registry.takes_ranks = False
        ranks = await join(registry, dealer(), JoinHelloF("a", ["cpu"], 1))
        assert isinstance(ranks, RefusedF) and "--lanes" in ranks.reason and not ranks.retry_s
        lanes = JoinHelloF("a", ["cpu", "cpu"], 2, [["cpu"], ["cpu"]])
        assert isinstance(await join(registry, dealer(), lanes), WelcomeF)
        assert registry.lane_host("a").lanes == [["cpu"], ["cpu"]] and registry.ready() == []
        twin = await join(registry, dealer(), JoinHelloF("a", ["cpu"], 3, [["cpu"]]))
        assert isinstance(twin, RefusedF) and twin.retry_s > 0

    _run(tmp_path, scenario)
