"""`twinkled serve --devices cpu,cpu --tp 2` through the unmodified tinker client: the same
losses, logprobs and greedy samples as the one-rank daemon, and checkpoints (and the
persisted live state) of whole tensors, whatever the split."""

from __future__ import annotations

import json
import time
from importlib.util import find_spec

import pytest

tinker = pytest.importorskip("tinker")
# Whether megatron-core is installed, without importing it (seconds of CPU in every test
# process that collects this file; the tp ranks import it themselves).
pytestmark = pytest.mark.skipif(find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (the megatron extra)")

from daemon import Daemon, make_key  # noqa: E402
from test_tinker_e2e import SENTENCES, T, datum, greedy  # noqa: E402


@pytest.fixture(scope="module")
def tp_daemon(tiny_dir, tmp_path_factory):
    """The module's one tensor-parallel daemon (a tp pair costs ~14 CPU-s to start), with
    `persist_every = 0`: the steps write no live state, the shutdown does (the last test
    stops it to see that); nothing the other tests assert depends on the steps' writes."""
    data = tmp_path_factory.mktemp("tpdata")
    conf = data / "twinkled.toml"
    conf.write_text("persist_every = 0\n")
    d = Daemon(tiny_dir, data, data / "twinkled.log", "--devices", "cpu,cpu", "--tp", "2",
               "--config", str(conf))
    d.keys = {"alice": make_key(data, "alice")}
    yield d
    d.stop()


def _scenario(daemon, tiny_dir) -> dict:
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=8, seed=0).result(timeout=T)
    tok = tc.get_tokenizer()
    data = [datum(tok, s) for s in SENTENCES]
    adam = tinker.types.AdamParams(learning_rate=5e-3)
    out = {"losses": []}
    for _ in range(3):
        fb = tc.forward_backward(data, "cross_entropy").result(timeout=T)
        out["losses"].append(fb.metrics["loss:sum"])
        out["norm"] = tc.optim_step(adam).result(timeout=T).metrics.get("grad_norm:mean")
    fwd = tc.forward(data, "cross_entropy").result(timeout=T)
    out["logprobs"] = [o["logprobs"].tolist() for o in fwd.loss_fn_outputs]
    sampler = tc.save_weights_and_get_sampling_client()
    out["greedy"] = greedy(sampler, tok, "the sun and", 8).tokens
    path = tc.save_state("tp-ckpt").result(timeout=T).path
    resumed = sc.create_training_client_from_state_with_optimizer(path).result(timeout=T)
    again = resumed.forward(data, "cross_entropy").result(timeout=T)
    out["resumed"] = [o["logprobs"].tolist() for o in again.loss_fn_outputs]
    sc.close("success")
    return out


def _live_shapes(root) -> dict:
    """Tensor shapes of the adapter's persisted live state (written behind the steps)."""
    deadline = time.time() + 30
    while time.time() < deadline and not list(root.glob("*/state.json")):
        time.sleep(0.2)
    index = json.loads(next(root.glob("*/state.json")).read_text())
    return {name: shape for _, name, shape in index["tensors"]}


def _close(a, b, rel=1e-4) -> bool:
    a, b = list(pytest.importorskip("numpy").ravel(a)), list(pytest.importorskip("numpy").ravel(b))
    worst = max(abs(x) for x in b)
    return len(a) == len(b) and all(abs(x - y) <= rel * worst for x, y in zip(a, b, strict=True))


def test_tp2_daemon_matches_one_rank(tp_daemon, daemon, tiny_dir):
    got, want = _scenario(tp_daemon, tiny_dir), _scenario(daemon, tiny_dir)
    assert _close(got["losses"], want["losses"]), (got["losses"], want["losses"])
    assert got["losses"][-1] < got["losses"][0]  # it trained
    assert got["norm"] == pytest.approx(want["norm"], rel=1e-4)
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        assert _close(a, b)
    assert got["greedy"] == want["greedy"]
    for a, b in zip(got["resumed"], got["logprobs"], strict=True):  # from the gathered files
        assert _close(a, b)
    # (The live state rank 0 persists holds whole tensors: the last test, at shutdown.)


def test_tp_daemon_reports_every_rank_and_its_peak_memory(tp_daemon):
    import urllib.request

    with urllib.request.urlopen(f"{tp_daemon.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    for rank in (0, 1):  # on a CPU the engine holds no device memory: 0
        assert f'twinkle_gpu_peak_memory_bytes{{device="cpu",lane="0",rank="{rank}"}} 0.0' in text


def test_tp_adapters_persist_behind_the_steps_and_at_shutdown(tp_daemon, tiny_dir):
    """A split adapter is gathered to be written only when the writer takes it, not at every
    optimizer step: with `persist_every = 0` the steps write nothing, and the shutdown
    writes the latest state, of whole tensors. (It stops the module's daemon: the file's
    last test.)"""
    sc = tinker.ServiceClient(base_url=tp_daemon.url, api_key=tp_daemon.keys["alice"])
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=8, seed=0).result(
        timeout=T)
    batch = [datum(tc.get_tokenizer(), s) for s in SENTENCES]
    for _ in range(3):
        tc.forward_backward(batch, "cross_entropy").result(timeout=T)
        tc.optim_step(tinker.types.AdamParams(learning_rate=5e-3)).result(timeout=T)
    live = tp_daemon.data_dir / "live" / tc.model_id
    # neither its creation (its seed makes it again) nor the three steps wrote a state
    assert not list(live.glob("*/state.json"))
    # (no sc.close: closing the session unloads its model, and its live state with it)
    tp_daemon.stop()
    assert _live_steps(live) == 3  # the shutdown persisted the latest state, whole
    q_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert _live_shapes(live)[q_b] == [128, 8]  # 2 heads x 64, not one rank's head


def _live_steps(root) -> int:
    return json.loads(next(root.glob("*/state.json")).read_text())["steps"]
