"""Crash and retry: random SIGKILLs of workers and of the daemon while 5 tenants train, save,
sample and retry what they lost (issue 28).

Each tenant runs the unmodified tinker client in a thread: per step a forward_backward and
the optim_step right behind it (pipelined, as tinker's cookbook does). A request whose
answer was lost in a daemon kill is resent by the client itself, with the same seq_id; a
request answered as failed (category server: a worker was lost) is redone as the client is
told to: the optim_step alone if only it failed, both if the forward_backward did (its
optim_step must then have failed too). Every few steps a tenant saves weights for sampling
and samples from them; two tenants stay away longer than `idle_unload_s` now and then.
Meanwhile a seeded schedule SIGKILLs the worker or the daemon (restarted on the same port
and data dir).

At the end: every call was answered within its timeout; every run is at its acknowledged
step (its logprobs are those of a twin trained, without crashes, on exactly the steps its
client was told are done); every checkpoint a client was told is ready loads and samples.

TWINKLE_CHAOS_S (default 8) is how long the kills go on; TWINKLE_CHAOS_SEED picks the
schedule; TWINKLE_CHAOS_TIERS=1 gives the daemon a GPU bank of 2 adapters and host memory for
2 more, so that the five runs are parked and brought back between their steps as well. The default run is short enough for the suite (about a minute on a
2-core box); set TWINKLE_CHAOS_S=300 for a soak.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest
from daemon import Daemon, make_key

tinker = pytest.importorskip("tinker")

CHAOS_S = float(os.environ.get("TWINKLE_CHAOS_S", "8"))
SEED = int(os.environ.get("TWINKLE_CHAOS_SEED", "28"))
# Budgets of about 2.5 rank-4 adapters of the tiny model (0.35 MiB each, gradients and
# moments included) in the GPU bank and in host memory (TWINKLE_CHAOS_TIERS)
TIERS = ("adapter_memory_gb = 0.00088\nhost_adapter_memory_gb = 0.00078\n"
         if os.environ.get("TWINKLE_CHAOS_TIERS") == "1" else "")
T = 180  # no call may wait longer than this for its answer (a restart takes ~15 s here)
# Each tenant rests this long after a step: back to back, the three busy ones acknowledged
# ~80 steps each in a default run, and this test's CPU went with that count (the steps, their
# saves and samples, and the twins' replay of every step at the end); kills still land while
# five tenants' requests are in flight.
PACE_S = 0.15
IDLE_S = 2.0  # idle_unload_s: two tenants stay away longer than this now and then
TENANTS = 5
TEXTS = ["the sun and the sea are big.", "a cat.", "one two three four five six seven",
         "red green blue", "to be or not to be"]


def _datum(tok, text: str):
    ids = tok(text).input_ids
    return tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                              loss_fn_inputs={"target_tokens": ids[1:]})


def _batch(tok, tenant: int, step: int) -> list:
    """What tenant `tenant` trains on at its step `step` (the same for its twin)."""
    return [_datum(tok, TEXTS[(tenant + step) % len(TEXTS)]),
            _datum(tok, TEXTS[(tenant * 3 + step * 2 + 1) % len(TEXTS)])]


def _adam(tenant: int):
    """Each tenant's optimizer, gentle on purpose. The run is co-batched with other tenants
    and its twin trains alone, and a co-batched pass rounds differently (~1e-7). At a large
    learning rate (1e-2) training this tiny model is chaotic: with no crash at all, run and
    twin part ways after ~15 steps (seen). At tinker's default eps (1e-12) Adam also turns
    a gradient of rounding size into a whole step of either sign."""
    return tinker.types.AdamParams(learning_rate=1e-4 * (tenant + 1), eps=1e-3)


@dataclass
class Tenant:
    index: int
    key: str
    acked: int = 0  # steps whose forward_backward and optim_step were both answered done
    redone: int = 0  # requests answered as failed (server) and sent again
    ready: list[str] = field(default_factory=list)  # checkpoints the client was told exist
    problems: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # each acknowledged step's loss
    tc: object = None  # its training client (resumed across daemon restarts)


def _failed(fut):
    """None if the request was answered done, else its error (a timeout is a problem)."""
    try:
        fut.result(timeout=T)
        return None
    except tinker.RequestFailedError as e:
        return e


def _train(url: str, base: str, tenant: Tenant, stop: threading.Event, away: bool) -> None:
    sc = tinker.ServiceClient(base_url=url, api_key=tenant.key)
    tc = sc.create_lora_training_client(base_model=base, rank=4,
                                        seed=100 + tenant.index).result(timeout=T)
    tenant.tc = tc
    tok = tc.get_tokenizer()
    adam = _adam(tenant.index)
    rng = random.Random(SEED * 100 + tenant.index)
    while not stop.is_set():
        if not _step(tc, tok, tenant, adam):
            return
        stop.wait(PACE_S)
        if away and rng.random() < 0.3:
            time.sleep(IDLE_S * 1.5)  # longer than idle_unload_s: the run is unloaded
    if away:  # once more after the kills: back after the run was unloaded while idle
        time.sleep(IDLE_S * 2)
        _step(tc, tok, tenant, adam)


def _step(tc, tok, tenant: Tenant, adam) -> bool:
    """One training step, redone as the client is told until both halves are done; False
    on a problem (recorded)."""
    step = tenant.acked
    fb = tc.forward_backward(_batch(tok, tenant.index, step), "cross_entropy")
    opt = tc.optim_step(adam)
    fb_error, opt_error = _failed(fb), _failed(opt)
    while fb_error is not None or opt_error is not None:
        for e in (fb_error, opt_error):
            if e is not None and str(e.category) != "server":
                tenant.problems.append(f"step {step}: failed as {e.category}: {e}")
                return False
        if fb_error is not None and opt_error is None:
            tenant.problems.append(f"step {step}: optim_step answered done behind a "
                                   f"failed forward_backward ({fb_error})")
            return False
        tenant.redone += 1
        if fb_error is not None:  # both again
            fb = tc.forward_backward(_batch(tok, tenant.index, step), "cross_entropy")
            fb_error = _failed(fb)
        opt_error = _failed(tc.optim_step(adam))
    tenant.losses.append(fb.result(timeout=T).metrics["loss:sum"])
    tenant.acked += 1
    if step % 2 == 1:
        _save_and_sample(tc, tenant, step)
    return True


def _save_and_sample(tc, tenant: Tenant, step: int) -> None:
    try:
        path = tc.save_weights_for_sampler(f"s{step}").result(timeout=T).path
    except tinker.RequestFailedError as e:
        if str(e.category) != "server":
            tenant.problems.append(f"save at step {step} failed as {e.category}: {e}")
        return  # not told it is ready: nothing to check
    tenant.ready.append(path)
    try:
        _sample(tc, path)
    except tinker.RequestFailedError as e:
        if str(e.category) != "server":  # a crash may take a sample: a server error
            tenant.problems.append(f"sampling {path} failed as {e.category}: {e}")


def _sample(client, path: str):
    sampler = client.create_sampling_client(model_path=path)
    if not isinstance(sampler, tinker.SamplingClient):  # a training client's: a future
        sampler = sampler.result(timeout=T)
    prompt = tinker.types.ModelInput.from_ints([5, 6, 7])
    params = tinker.types.SamplingParams(max_tokens=2, temperature=0.0)
    out = sampler.sample(prompt, num_samples=1, sampling_params=params).result(timeout=T)
    assert len(out.sequences[0].tokens) > 0
    return out


def _logprobs(tc, tok, tenant: int) -> list[float]:
    data = [_datum(tok, t) for t in TEXTS]
    out = tc.forward(data, "cross_entropy").result(timeout=T)
    return [x for o in out.loss_fn_outputs for x in o["logprobs"].tolist()]


class Chaos:
    """The daemon, killed on a seeded schedule: a worker (the daemon restarts the group) or
    the daemon itself (restarted here on the same port and data dir)."""

    def __init__(self, daemon: Daemon, make, rng: random.Random):
        self.daemon, self.make, self.rng = daemon, make, rng
        self.kills = {"worker": 0, "daemon": 0}
        self.errors: list[str] = []

    def run(self, seconds: float) -> None:
        """Kills every 2-6 s for `seconds`: a worker first, the daemon at least once."""
        end = time.monotonic() + seconds
        while True:
            time.sleep(self.rng.uniform(2.0, 6.0))
            last = time.monotonic() >= end
            if last and self.kills["daemon"]:
                return
            try:
                if last or (self.kills["worker"] and self.rng.random() < 0.35):
                    self._kill_daemon()
                else:
                    self._kill_worker()
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.errors.append(f"{type(e).__name__}: {e}")
                return

    def _kill_worker(self) -> None:
        pids = self.daemon.workers()
        if not pids:
            return
        os.kill(pids[0], signal.SIGKILL)
        self.kills["worker"] += 1
        self.daemon.wait_workers(1, old=set(pids), timeout=T)

    def _kill_daemon(self) -> None:
        self.daemon.stop(signal.SIGKILL)
        self.kills["daemon"] += 1
        time.sleep(self.rng.uniform(0.0, 1.0))
        self.daemon = self.make(self.daemon.port)


def test_random_kills_lose_no_acknowledged_step_and_leave_no_request_unanswered(
        tiny_dir, tmp_path):
    cfg = tmp_path / "twinkled.toml"
    cfg.write_text(f"persist_every = 3\nidle_unload_s = {IDLE_S}\n{TIERS}")
    keys = [make_key(tmp_path, f"t{i}") for i in range(TENANTS)]
    logs = iter(range(1000))

    def make(port=None):
        d = Daemon(tiny_dir, tmp_path, tmp_path / f"log{next(logs)}", "--config", str(cfg),
                   port=port, wait=False)
        try:  # a restart restores every live run, replaying its journal: slow on a busy box
            d.wait_ready(timeout=3 * T)
        except BaseException:
            d.stop()
            raise
        return d

    chaos = Chaos(make(), make, random.Random(SEED))
    tenants = [Tenant(i, k) for i, k in enumerate(keys)]
    stop = threading.Event()
    threads = [threading.Thread(target=_guard, args=(chaos.daemon.url, tiny_dir.name, t, stop,
                                                     t.index >= 3), daemon=True)
               for t in tenants]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + T
        while not all(t.acked or t.problems for t in tenants) and time.monotonic() < deadline:
            time.sleep(0.2)  # every tenant trains before the first kill
        chaos.run(CHAOS_S)
        stop.set()
        for t in threads:
            t.join(timeout=4 * T)
        assert not [t for t in threads if t.is_alive()], "a tenant's call was never answered"
        assert not chaos.errors, chaos.errors
        problems = [f"tenant {t.index}: {p}" for t in tenants for p in t.problems]
        assert not problems, "\n".join(problems)
        assert all(t.acked > 0 for t in tenants), [t.acked for t in tenants]
        _check_runs(chaos.daemon, tiny_dir, tenants)
        print(f"chaos: {chaos.kills}, acknowledged steps {[t.acked for t in tenants]}, "
              f"redone {sum(t.redone for t in tenants)}, checkpoints "
              f"{sum(len(t.ready) for t in tenants)}")
    finally:
        stop.set()
        chaos.daemon.stop()


def _guard(url, base, tenant: Tenant, stop, away) -> None:
    try:
        _train(url, base, tenant, stop, away)
    except Exception as e:  # noqa: BLE001 - a timeout, an unexpected refusal: reported
        tenant.problems.append(f"{type(e).__name__}: {e}")


def _check_runs(daemon: Daemon, tiny_dir, tenants: list[Tenant]) -> None:
    """Each run against its twin, trained without crashes on its acknowledged steps; each
    checkpoint its client was told is ready, sampled."""
    for t in tenants:
        sc = tinker.ServiceClient(base_url=daemon.url, api_key=t.key)
        twin = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                              seed=100 + t.index).result(timeout=T)
        tok = twin.get_tokenizer()
        adam = _adam(t.index)
        got = _logprobs(t.tc, tok, t.index)  # the run itself, through its own client
        seen = {}  # the twin's logprobs after each step: which one (if any) the run matches
        losses = []  # the twin's loss at each step: where the run's first differed
        for step in range(t.acked + 2):
            seen[step] = _logprobs(twin, tok, t.index)
            fb = twin.forward_backward(_batch(tok, t.index, step), "cross_entropy")
            losses.append(fb.result(timeout=T).metrics["loss:sum"])
            twin.optim_step(adam).result(timeout=T)
        seen[t.acked + 2] = _logprobs(twin, tok, t.index)
        # Where the run is: the twin's step nearest to it. A step run twice or lost puts it
        # nearer the twin one step on or back; co-batching rounds differently from the
        # twin's passes alone, so "equal" is "much nearer than one step is long".
        far = {k: max(abs(a - b) for a, b in zip(got, lp, strict=True)) for k, lp in seen.items()}
        step_len = min(max(abs(a - b) for a, b in zip(seen[k], seen[k + 1], strict=True))
                       for k in (t.acked - 1, t.acked))
        first = next((i for i, (a, b) in enumerate(zip(t.losses, losses, strict=False)) if
                      a != pytest.approx(b, rel=1e-4, abs=1e-5)), None)
        assert min(far, key=far.get) == t.acked and far[t.acked] < step_len / 4, (
            f"tenant {t.index}: its run is not at its {t.acked} acknowledged step(s); "
            f"distance to the twin after k steps: "
            f"{ {k: round(v, 5) for k, v in far.items() if abs(k - t.acked) <= 3} }, one "
            f"step: {step_len:.5f}; its losses first differ at step {first}: "
            f"{None if first is None else (t.losses[first], losses[first])}")
        for path in t.ready:
            _sample(sc, path)  # every checkpoint its client was told is ready loads
