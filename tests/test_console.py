"""The web console (twinkled/server/console.py): its JSON through a real daemon with two
tenants training, and its pages in a real headless Chromium (skipped without one)."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import os
import shutil
import tarfile
import threading
import urllib.error
import urllib.request
from urllib.parse import urljoin

import aiohttp
import pytest
from aiohttp import web

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

T = 120
TEXTS = ["the sun and the sea are big.", "a cat sat on the mat."]
CHROMIUM = "/usr/bin/chromium"
BROWSER_T = 30  # seconds a page may take to show (a local daemon answers in well under 1)


def get(daemon, path: str, key: str | None = None) -> tuple[int, bytes]:
    """`path` relative to the console's page, as the page resolves its URLs."""
    return get_url(urljoin(daemon.url + "/console/", path), key)


def get_url(url: str, key: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"X-API-Key": key} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def get_json(daemon, path: str, key: str) -> dict:
    status, body = get(daemon, path, key)
    assert status == 200, (path, status, body[:300])
    return json.loads(body)


def train(daemon, tiny_dir, tenant: str, steps: int, save: str | None = None,
          sample: bool = False) -> dict:
    """`steps` rounds of forward_backward + optim_step: the run id, and what the client got."""
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys[tenant])
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=T)
    tok = tc.get_tokenizer()
    data = []
    for text in TEXTS:
        ids = tok(text).input_ids
        data.append(tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}))
    losses, optim = [], []
    for _ in range(steps):
        losses.append(tc.forward_backward(data, "cross_entropy").result(timeout=T).metrics)
        optim.append(tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2))
                     .result(timeout=T).metrics)
    path = tc.save_state(save).result(timeout=T).path if save else None
    out = {"run": tc.model_id, "losses": losses, "optim": optim, "path": path,
           "tokens": sum(len(d.model_input.to_ints()) for d in data)}
    if sample:  # two sampling calls of the trained weights (the console keeps the last ones)
        sampler = tc.save_weights_and_get_sampling_client().result(timeout=T)
        out["prompts"] = [tok(t).input_ids for t in TEXTS]
        out["samples"] = [sampler.sample(tinker.types.ModelInput.from_ints(p), 2,
                                         tinker.types.SamplingParams(max_tokens=4, seed=1))
                          .result(timeout=T) for p in out["prompts"]]
    return out


@pytest.fixture(scope="module")
def runs(daemon, tiny_dir):
    """alice trains 3 steps and saves; bob trains 2."""
    return {"alice": train(daemon, tiny_dir, "alice", 3, save="console-ckpt", sample=True),
            "bob": train(daemon, tiny_dir, "bob", 2)}


@pytest.fixture(scope="module")
def reported(daemon, runs):
    """alice's script reports a reward per step of its own (twinkle_sdk's sink, and the
    tinker-cookbook logger that wraps it): step 1 twice, its names merged."""
    from twinkle_sdk.tracking import DaemonMetrics

    sink = DaemonMetrics(daemon.url, daemon.keys["alice"], runs["alice"]["run"])
    sink.log({"reward/mean": 0.25, "kl": 0.5}, 1)
    sink.log({"reward/mean": 0.5, "note": "not a number", "nan": float("nan")}, 2)
    sink.log({"kl": 0.125}, 1)
    if importlib.util.find_spec("tinker_cookbook") is not None:
        from twinkle_sdk.cookbook_log import TwinkleMetricsLogger

        cookbook = TwinkleMetricsLogger(daemon.url, daemon.keys["alice"],
                                        lambda: runs["alice"]["run"])
        cookbook.log_metrics({"reward/mean": 0.75, "env/text": "hi"}, step=3)
        cookbook.log_metrics({"reward/mean": 9.0})  # no step: not a curve's point
    else:
        sink.log({"reward/mean": 0.75}, 3)
    return [(1, {"reward/mean": 0.25, "kl": 0.125}), (2, {"reward/mean": 0.5}),
            (3, {"reward/mean": 0.75})]


def post(daemon, path: str, body, key: str | None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(daemon.url + path, data=data, method="POST",
                                 headers={"X-API-Key": key} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_client_metrics_are_drawn_beside_the_runs_own(daemon, runs, reported):
    body = get_json(daemon, f"api/runs/{runs['alice']['run']}", daemon.keys["alice"])
    assert [(p["step"], p["metrics"]) for p in body["client_metrics"]] == reported


def test_client_metrics_are_checked_at_the_door(daemon, runs, reported):
    alice, bob = runs["alice"]["run"], runs["bob"]["run"]
    route = f"/twinkle/v1/runs/{alice}/metrics"
    ok = {"points": [{"step": 9, "metrics": {"reward/mean": 1.0}}]}
    assert post(daemon, route, ok, daemon.keys["bob"]) == (
        404, {"detail": f"no training run {alice!r}"})
    assert post(daemon, route, ok, admin_key(daemon))[0] == 401  # the admin key only reads
    assert post(daemon, route, ok, None)[0] == 401
    for bad, says in [
            ({"points": [{"step": 9, "metrics": {"reward mean": 1.0}}]}, "metrics"),
            ({"points": [{"step": -1, "metrics": {"r": 1.0}}]}, "points[0].step"),
            ({"points": [{"step": 9, "metrics": {"r": "high"}}]}, "points[0].metrics"),
            ({"points": [{"step": 9, "metrics": {f"m{i}": 1 for i in range(65)}}]}, "metrics"),
            ({"points": [{"step": 9, "metrics": {}}]}, "metrics"),
            ({"points": []}, "points"),
            ({"points": [{"step": 9, "metrics": {"r": 1.0}, "extra": 1}]}, "extra"),
            (b'{"points": [{"step": 9, "metrics": {"r": 1e999}}]}', "out of range"),
            (b'{"points": [{"step": 9, "metrics": {"r": NaN}}]}', "JSON")]:
        status, got = post(daemon, route, bad, daemon.keys["alice"])
        assert status == 400 and says in got["detail"], (bad, status, got)
    # nothing of the refused reports was kept; bob's own run takes his
    body = get_json(daemon, f"api/runs/{alice}", daemon.keys["alice"])
    assert [(p["step"], p["metrics"]) for p in body["client_metrics"]] == reported
    assert post(daemon, f"/twinkle/v1/runs/{bob}/metrics", ok, daemon.keys["bob"]) == (
        200, {"run_id": bob, "points": 1})


def test_report_to_twinkle_from_a_model_on_the_daemon(daemon, tiny_dir):
    """twinkle_sdk's model with report_to="twinkle": calculate_metric's means on its run."""
    import twinkle_sdk as twinkle
    from twinkle_sdk.runtime import runtime

    before = runtime.client, runtime.mode
    try:
        twinkle.init_twinkle_client(daemon.url, daemon.keys["bob"])
        model = twinkle.MultiLoraTransformersModel(model_id=str(tiny_dir), report_to="twinkle")
        model.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8})
        model.set_optimizer("AdamW", lr=1e-2)
        model.forward_backward(inputs=[{"input_ids": [9, 40, 70, 100],
                                        "labels": [-100, -100, 70, 100]}])
        model.clip_grad_and_step()
        means = model.calculate_metric(is_training=True)
        run = model.backend.tc.model_id
    finally:
        runtime.client, runtime.mode = before
    body = get_json(daemon, f"api/runs/{run}", daemon.keys["bob"])
    [point] = body["client_metrics"]
    assert point["step"] == 1
    assert point["metrics"]["train/loss"] == pytest.approx(means["loss"])


def admin_key(daemon) -> str:
    return (daemon.data / "admin.key").read_text().strip()


def test_a_runs_curve_has_the_points_the_daemon_recorded(daemon, runs):
    alice = runs["alice"]
    body = get_json(daemon, f"api/runs/{alice['run']}", daemon.keys["alice"])
    assert body["run"]["id"] == alice["run"] and body["run"]["tenant"] == "alice"
    fb = [s for s in body["steps"] if s["kind"] == "forward_backward"]
    opt = [s for s in body["steps"] if s["kind"] == "optim_step"]
    # Every step, in order, with the very numbers the client was answered
    # (element by element: pytest >= 9.2's approx refuses a list of dicts)
    for got, want in ((fb, alice["losses"]), (opt, alice["optim"])):
        assert len(got) == len(want)
        for s, w in zip(got, want, strict=True):
            assert s["metrics"] == pytest.approx(w)
    assert [s["tokens"] for s in fb] == [alice["tokens"]] * 3
    seqs = [s["seq_id"] for s in body["steps"]]
    assert seqs == sorted(seqs) and len(seqs) == 6
    listed = {r["id"]: r for r in get_json(daemon, "api/runs", daemon.keys["alice"])["runs"]}
    assert listed[alice["run"]]["steps"] == 6


def test_a_runs_last_sampling_calls_decoded(daemon, runs, tiny_dir):
    """What alice's run sampled, newest first, as her client was answered, with the text
    the model's tokenizer gives; not bob's to read."""
    from transformers import AutoTokenizer

    alice = runs["alice"]
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    calls = get_json(daemon, f"api/runs/{alice['run']}/samples", daemon.keys["alice"])["samples"]
    assert len(calls) == 2
    for call, prompt, got in zip(calls, alice["prompts"][::-1], alice["samples"][::-1],
                                 strict=True):
        assert call["prompt"] == prompt and call["prompt_tokens"] == len(prompt)
        assert call["prompt_text"] == tok.decode(prompt, skip_special_tokens=True)
        assert call["num_samples"] == 2 and call["tenant"] == "alice"
        for s, want in zip(call["sequences"], got.sequences, strict=True):
            assert s["tokens"] == want.tokens and s["stop_reason"] == want.stop_reason
            assert s["logprob_sum"] == pytest.approx(sum(want.logprobs), abs=1e-4)
            assert s["text"] == tok.decode(want.tokens, skip_special_tokens=True)
    assert get(daemon, f"api/runs/{alice['run']}/samples", daemon.keys["bob"])[0] == 404
    admin = get_json(daemon, f"api/runs/{alice['run']}/samples", admin_key(daemon))
    assert admin["samples"] == calls
    bobs = get_json(daemon, f"api/runs/{runs['bob']['run']}/samples", daemon.keys["bob"])
    assert bobs["samples"] == []


def test_a_checkpoint_downloads_from_its_relative_link(daemon, runs):
    body = get_json(daemon, f"api/runs/{runs['alice']['run']}", daemon.keys["alice"])
    [ckpt] = [c for c in body["checkpoints"] if c["tinker_path"] == runs["alice"]["path"]]
    assert ckpt["download"].startswith("../")  # relative: a proxy's path prefix is kept
    status, tar = get(daemon, ckpt["download"])  # no key: the link is signed
    assert status == 200
    names = tarfile.open(fileobj=io.BytesIO(tar)).getnames()
    assert "adapter_model.safetensors" in names


def test_a_tenant_sees_only_its_own_runs(daemon, runs):
    alice, bob = runs["alice"]["run"], runs["bob"]["run"]
    bobs = {r["id"] for r in get_json(daemon, "api/runs", daemon.keys["bob"])["runs"]}
    assert bob in bobs and alice not in bobs
    status, body = get(daemon, f"api/runs/{alice}", daemon.keys["bob"])
    assert status == 404 and alice in json.loads(body)["detail"]
    sessions = get_json(daemon, "api/sessions", daemon.keys["bob"])["sessions"]
    assert {s["tenant"] for s in sessions} == {"bob"}
    assert not any(alice in s["runs"] for s in sessions)
    op = get_json(daemon, "api/operator", daemon.keys["bob"])
    assert set(op["tenants"]) <= {"bob"} and "workers" not in op
    assert op["state"] == "ready"  # the daemon's life cycle, as the page shows it
    assert get_json(daemon, "api/me", daemon.keys["bob"])["state"] == "ready"
    # the admin key sees both tenants' runs and the whole status
    admin = admin_key(daemon)
    every = {r["id"] for r in get_json(daemon, "api/runs", admin)["runs"]}
    assert {alice, bob} <= every
    assert get_json(daemon, f"api/runs/{bob}", admin)["run"]["tenant"] == "bob"
    op = get_json(daemon, "api/operator", admin)
    assert {"alice", "bob"} <= set(op["tenants"]) and op["workers"]


def test_no_key_no_data_but_the_page_loads(daemon):
    assert get(daemon, "api/runs")[0] == 401
    assert get(daemon, "api/runs", "tml-not-a-key")[0] == 401
    status, page = get(daemon, "")
    assert status == 200 and b"console.js" in page
    assert get(daemon, "console.js")[0] == 200
    assert get(daemon, "../../etc/passwd")[0] in (401, 404)


class PrefixProxy:
    """A reverse proxy serving the daemon under /team/twinkle/ (what nginx's
    `location /team/twinkle/ { proxy_pass http://daemon/; }` does), in a thread."""

    PREFIX = "/team/twinkle/"

    def __init__(self, target: str):
        self.target, self.started = target, threading.Event()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._serve, daemon=True).start()
        assert self.started.wait(30), "the proxy did not start"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_route("*", self.PREFIX + "{tail:.*}", self._forward)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.started.set()
        self.loop.run_forever()

    async def _forward(self, request: web.Request) -> web.Response:
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("x-api-key", "authorization", "accept", "content-type")}
        async with aiohttp.ClientSession() as http, http.request(
                request.method, f"{self.target}/{request.match_info['tail']}",
                params=request.query, headers=headers, data=await request.read(),
                allow_redirects=False) as r:
            keep = {k: v for k, v in r.headers.items()
                    if k.lower() in ("content-type", "location", "content-disposition")}
            return web.Response(status=r.status, body=await r.read(), headers=keep)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _browser():
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    return playwright


def test_the_console_in_a_real_browser(daemon, runs, reported, tmp_path):
    """Through a proxy that serves the daemon under a path prefix: every URL the page
    uses must be relative for any of this to work."""
    playwright = _browser()
    alice = runs["alice"]
    proxy = PrefixProxy(daemon.url)
    console = proxy.url + PrefixProxy.PREFIX + "console"
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(console, timeout=BROWSER_T * 1000)  # redirected to .../console/
            page.fill("#key", daemon.keys["alice"])
            page.click("#login button")
            page.wait_for_selector('#view[data-page="runs"] table', timeout=BROWSER_T * 1000)
            page.screenshot(path=str(tmp_path / "runs.png"), full_page=True)
            link = page.get_by_role("link", name=alice["run"], exact=True)
            assert link.count() == 1
            assert runs["bob"]["run"] not in page.inner_text("#view")
            link.click()
            curve = page.locator('#view[data-page="run"] svg[data-metric="forward_backward loss:sum"]')
            curve.wait_for(timeout=BROWSER_T * 1000)
            page.screenshot(path=str(tmp_path / "run.png"), full_page=True)
            assert page.url.startswith(console + "/#/run/")
            assert curve.get_attribute("data-points") == "3"
            assert curve.locator("circle").count() == 3
            drawn = curve.locator("polyline").get_attribute("points").split()
            assert len(drawn) == 3
            # what the client reported: a reward curve against its own steps
            reward = page.locator('#client-curves svg[data-metric="client reward/mean"]')
            assert reward.get_attribute("data-points") == "3"
            assert reward.locator("circle").count() == 3
            # the run's last sampling calls, newest first, its completions' text
            rows = page.locator("#samples tbody tr")
            assert rows.count() == 2
            assert "logprob sum" in rows.first.inner_text()
            # the checkpoint's download link, followed from the page, through the prefix
            href = page.get_by_role("row", name=alice["path"]).get_by_role(
                "link", name="download (.tar)").get_attribute("href")
            status, tar = get_url(urljoin(page.url, href))
            assert status == 200 and "adapter_model.safetensors" in \
                tarfile.open(fileobj=io.BytesIO(tar)).getnames()
            for name in ("sessions", "operator"):
                page.click(f'#nav a[href="#/{name}"]')
                page.wait_for_selector(f'#view[data-page="{name}"] table', timeout=BROWSER_T * 1000)
                page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
            assert "alice" in page.inner_text("#view")
            # The operator: every tenant's share, the workers and their memory
            page.click("#logout")
            page.fill("#key", admin_key(daemon))
            page.click("#login button")
            page.wait_for_selector('#view[data-page="operator"] table', timeout=BROWSER_T * 1000)
            page.wait_for_selector("text=Workers", timeout=BROWSER_T * 1000)
            page.screenshot(path=str(tmp_path / "operator-admin.png"), full_page=True)
            text = page.inner_text("#view")
            assert "alice" in text and "bob" in text and "peak memory" in text
            # the list: lanes, memory and utilisation, queue depth, shares against
            # weights, residency, and the way to the sessions' traces
            assert page.locator("#lanes tbody tr").count() == 1  # one lane: its own row
            assert "utilisation" in page.inner_text("#workers thead")
            assert "%" in page.inner_text("#workers tbody")
            assert page.inner_text("#queue").startswith("queue depth: ")
            assert "weight's share" in page.inner_text("#tenants thead")
            assert page.locator("#tenants .mark").count() >= 2
            assert "Adapter residency" in text and "Sessions and their traces" in text
        finally:
            browser.close()
            proxy.close()
    print(f"console screenshots: {tmp_path}")


def test_recent_samples_are_bounded_and_kept_per_tenant():
    """The ring's bounds (calls per run, runs, ids), and another tenant's calls on a run
    (sampling its public checkpoint) are not the owner's to read."""
    from types import SimpleNamespace

    from twinkled.core import recent_samples as rs

    ring = rs.RecentSamples(per_run=2, runs=2)
    seq = SimpleNamespace(tokens=list(range(rs.MAX_SEQUENCE + 5)), logprobs=[-0.5, -0.25],
                          stop_reason="length")
    for i in range(3):
        ring.put("r1", "alice", "s", [7] * i + list(range(rs.MAX_PROMPT + 1)),
                 [seq] * (rs.MAX_SEQUENCES + 1))
    ring.put("r1", "bob", "s2", [1, 2], [seq])
    [bobs, alices] = ring.of_run("r1", None)  # two kept, newest first
    assert ring.of_run("r1", "alice") == [alices] and ring.of_run("r1", "bob") == [bobs]
    assert alices["prompt"] == list(range(1, rs.MAX_PROMPT + 1))  # its end
    assert alices["prompt_tokens"] == rs.MAX_PROMPT + 3 and alices["num_samples"] == 5
    [s0, *_] = alices["sequences"]
    assert len(alices["sequences"]) == rs.MAX_SEQUENCES
    assert s0["tokens"] == list(range(rs.MAX_SEQUENCE)) and s0["tokens_n"] == rs.MAX_SEQUENCE + 5
    assert s0["logprob_sum"] == -0.75
    ring.put("r2", "alice", "s", [1], [seq])
    ring.put("r3", "alice", "s", [1], [seq])  # r1, sampled least recently, is forgotten
    assert ring.of_run("r1", None) == [] and len(ring.of_run("r3", "alice")) == 1
    assert rs.run_of_path("tinker://run-1/sampler_weights/x") == "run-1"
    assert rs.run_of_path("tiny-qwen3") is None and rs.run_of_path(None) is None


def test_client_metrics_per_run_cap_and_merge(tmp_path, monkeypatch):
    from twinkled.protocol.errors import UserError
    from twinkled.store import Store
    from twinkled.store import steps as steps_module

    monkeypatch.setattr(steps_module, "MAX_CLIENT_STEPS", 3)
    store = Store(tmp_path / "db.sqlite")
    try:
        store.client_metrics.report("r", [(1, {"a": 1.0}), (2, {"a": 2.0}), (1, {"b": 3.0})])
        store.client_metrics.report("r", [(3, {"a": 4.0}), (2, {"a": 5.0})])
        with pytest.raises(UserError, match="at most 3 steps"):  # a fourth step: none kept
            store.client_metrics.report("r", [(2, {"c": 6.0}), (4, {"a": 7.0})])
        store.client_metrics.report("other", [(4, {"a": 7.0})])  # the cap is per run
        got = [(p["step"], p["metrics"]) for p in store.client_metrics.of_run("r")]
        assert got == [(1, {"a": 1.0, "b": 3.0}), (2, {"a": 5.0}), (3, {"a": 4.0})]
    finally:
        store.close()
