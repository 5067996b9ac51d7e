"""Issue 11: one tenant cannot hurt another.

Each trigger of the issue is fired by a "bad" tenant while a "good" tenant trains in the same
daemon. Every test checks, and reports together:
  (a) the bad request is refused as a user error naming the offending field: a clean 4xx
      (400..429, not 408/409) whose detail names it, or a future failing with category
      "user" that names it (through the tinker client: BadRequestError & co. or
      RequestFailedError, at once, not after a retry loop);
  (b) the good tenant's concurrent forward_backward + optim_step completes without error;
  (c) `twinkle_worker_restarts_total` does not move, the daemon does not die, and it answers
      no 5xx meanwhile;
  (d) the bad tenant's next normal request completes (a refused seq_id-carrying request
      consumes its seq_id, so the client's next one does not wait forever).
The last test kills the worker mid-training with four tenants and checks that every adapter
is exactly at its acknowledged step (loss equal to a control run's).

Every wait has a timeout: a hang is a failure with a message, never a stuck test.
"""

from __future__ import annotations

import math
import os
import re
import signal
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hostile import (
    NEXT_T,
    Box,
    Checks,
    Raw,
    T,
    Watch,
    fwdbwd_proto,
    is_clean_4xx,
    pb,
    sample_tokens,
)

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")
types = tinker.types

TENANTS = ("good", "bad", "k1", "k2", "k3", "k4", "control")
TEXTS = ["the sun and the sea are big.", "a cat sat on the mat.", "one two three four five"]


# -- the daemon and its tenants -----------------------------------------------------------


@pytest.fixture(scope="module")
def box(tiny_dir, tmp_path_factory):
    Raw.base_model = tiny_dir.name
    b = Box(tiny_dir, tmp_path_factory.mktemp("isolation"), "poll_seconds = 2.0\n", TENANTS)
    yield b
    b.stop()


@pytest.fixture(autouse=True)
def healthy(box):
    """Every test starts on a healthy daemon (one that an earlier test killed is back)."""
    box.ensure_up()
    box.take_trips()  # reported by the test that caused them
    yield


def cancel(fut) -> None:
    """Stop the client's retry loop behind a future we gave up on."""
    f = getattr(fut, "future", None)
    if callable(f):
        f().cancel()


def wait(fut, what: str, timeout: float = T):
    try:
        return fut.result(timeout=timeout)
    except TimeoutError:
        cancel(fut)
        raise AssertionError(f"{what}: no answer in {timeout:.0f} s (hang, or the client is "
                             "retrying a 5xx/408/409/429)") from None


def make_data(tok, texts=TEXTS) -> list:
    out = []
    for text in texts:
        ids = tok(text).input_ids
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]}))
    return out


class Tenant:
    """One tenant's tinker ServiceClient and a LoRA training client on the tiny model."""

    def __init__(self, box: Box, name: str, base_model: str, seed: int | None = None,
                 lr: float = 1e-2, texts=TEXTS, sc=None):
        self.name, self.lr, self.seed, self.base_model = name, lr, seed, base_model
        self.sc = sc or tinker.ServiceClient(base_url=box.url, api_key=box.keys[name])
        self.tc = self.sc.create_lora_training_client(base_model=base_model, rank=4,
                                                      seed=seed).result(timeout=T)
        self.tok = self.tc.get_tokenizer()
        self.data = make_data(self.tok, texts)
        self._sampler = None

    def start(self):
        """The good tenant's forward_backward, in flight while the bad request is sent."""
        return self.tc.forward_backward(self.data, "cross_entropy")

    def good_round(self, started=None, timeout: float = T) -> None:
        """forward_backward (or the one already started) + optim_step, both without error."""
        fb = started if started is not None else self.start()
        out = wait(fb, f"{self.name}'s forward_backward", timeout)
        assert out.metrics["loss:sum"] > 0, out.metrics
        wait(self.tc.optim_step(types.AdamParams(learning_rate=self.lr)),
             f"{self.name}'s optim_step", timeout)

    @property
    def sampler(self):
        if self._sampler is None:
            s = self.sc.create_sampling_client(base_model=self.base_model)
            self._sampler = s if hasattr(s, "sample") and not hasattr(s, "result") else \
                s.result(timeout=T)
        return self._sampler

    def sample(self, timeout: float = NEXT_T) -> None:
        prompt = types.ModelInput.from_ints(self.tok("the sun").input_ids)
        out = wait(self.sampler.sample(prompt, 1, types.SamplingParams(max_tokens=3)),
                   f"{self.name}'s sample", timeout)
        assert len(out.sequences) == 1


_clients: dict = {}


def _cached(box: Box, key: str, make: Callable):
    """One object per daemon generation (a daemon brought back gets fresh clients)."""
    k = (key, box.generation)
    if k not in _clients:
        _clients[k] = make()
    return _clients[k]


@pytest.fixture()
def good(box, tiny_dir) -> Tenant:
    return _cached(box, "good", lambda: Tenant(box, "good", tiny_dir.name, seed=1))


@pytest.fixture()
def bad_sc(box):
    return _cached(box, "bad_sc", lambda: tinker.ServiceClient(base_url=box.url,
                                                               api_key=box.keys["bad"]))


@pytest.fixture()
def bad(box, bad_sc, tiny_dir) -> Tenant:
    """A fresh training client of the bad tenant for every test (a wedged one stays behind)."""
    return Tenant(box, "bad", tiny_dir.name, seed=2, sc=bad_sc)


# -- (a) through the tinker client ----------------------------------------------------------


def sdk_refused(call: Callable, field: str, timeout: float = NEXT_T) -> None:
    """`call()` -> a tinker future; it must fail at once as a user error naming `field`."""
    fut = call()
    try:
        value = fut.result(timeout=timeout)
    except TimeoutError:
        cancel(fut)
        raise AssertionError(f"no answer in {timeout:.0f} s: the tinker client is retrying "
                             "(the server answered 5xx/408/409/429) or the request hangs") from None
    except tinker.RequestFailedError as e:
        assert str(e.category) == "user", \
            f"failed with category {str(e.category)!r}, not 'user': {e.message[:300]}"
        assert re.search(field, e.message, re.I), \
            f"the error does not name {field!r}: {e.message[:300]}"
        return
    except tinker.APIStatusError as e:
        assert is_clean_4xx(e.status_code), f"HTTP {e.status_code}: {str(e)[:300]}"
        assert re.search(field, str(e), re.I), f"the {e.status_code} does not name {field!r}: " \
                                               f"{str(e)[:300]}"
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"unexpected {type(e).__name__}: {str(e)[:300]}") from None
    raise AssertionError(f"accepted: it returned {str(value)[:200]}")


def _empty_datum(t: Tenant):
    d = types.Datum(model_input=types.ModelInput(chunks=[]), loss_fn_inputs={"target_tokens": []})
    return t.tc.forward_backward([d], "cross_entropy")


def _empty_prompt(t: Tenant):
    return t.sampler.sample(types.ModelInput(chunks=[]), 1, types.SamplingParams(max_tokens=3))


def _image_chunk(t: Tenant):
    png = b"\x89PNG\r\n\x1a\n" + bytes(64)
    mi = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 6]),
                                  types.ImageChunk(data=png, format="png", expected_tokens=2)])
    d = types.Datum(model_input=mi, loss_fn_inputs={"target_tokens": [6, 7, 8, 9]})
    return t.tc.forward_backward([d], "cross_entropy")


def _save_twice(t: Tenant):
    wait(t.tc.save_state("dup"), "the first save_state('dup')")
    return t.tc.save_state("dup")


@dataclass
class SdkTrigger:
    call: Callable  # Tenant -> future
    field: str  # what the refusal must name (a regex)
    next: str = "round"  # the bad tenant's next request: "round" or "sample"


SDK_TRIGGERS = {
    "forward_backward_empty_datum": SdkTrigger(_empty_datum, r"model_input|tokens|data\[0\]|empty"),
    "sample_empty_prompt": SdkTrigger(_empty_prompt, r"prompt", "sample"),
    "save_state_name_250_chars": SdkTrigger(lambda t: t.tc.save_state("n" * 250), r"name|path"),
    "save_state_name_dotdot_slash": SdkTrigger(lambda t: t.tc.save_state("../x"), r"name|path"),
    "save_state_existing_name": SdkTrigger(_save_twice, r"exist|overwrite"),
    "optim_step_dimuon_params": SdkTrigger(
        lambda t: t.tc.optim_step(types.DimuonParams(learning_rate=1e-3)),
        r"dimuon|optimi[sz]er|adam"),
    "loss_fn_config_string_value": SdkTrigger(
        lambda t: t.tc.forward_backward(t.data, "cross_entropy",
                                        loss_fn_config={"clip_low_threshold": "abc"}),
        r"loss_fn_config"),
    "model_input_image_chunk": SdkTrigger(_image_chunk, r"image|chunk|model_input"),
}


def isolate(box: Box, good: Tenant, bad_request: Callable, next_request: Callable,
            after: Callable | None = None) -> None:
    """The bad request, fired while the good tenant's forward_backward is in flight; then
    the checks (a) to (d), all reported together."""
    watch, checks = Watch(box), Checks()
    started = good.start()
    checks.check("(a) bad request", bad_request)
    if box.alive():
        checks.check("(b) good tenant's concurrent round", good.good_round, started)
        checks.add(box.wait_healthy())
        if after is not None:
            after(checks)
        checks.check("(d) bad tenant's next request", next_request)
    else:
        cancel(started)
    checks.add(*("(c) " + p for p in watch.problems()))
    checks.done()


@pytest.mark.parametrize("name", list(SDK_TRIGGERS))
def test_sdk_trigger(name, box, good, bad):
    trig = SDK_TRIGGERS[name]
    isolate(box, good, lambda: sdk_refused(lambda: trig.call(bad), trig.field),
            bad.sample if trig.next == "sample" else lambda: bad.good_round(None, NEXT_T))


# -- (a) through raw HTTP ---------------------------------------------------------------------


class Ctx:
    """The bad tenant over raw HTTP: one session and sampler per daemon, a model per test."""

    def __init__(self, box: Box):
        self.raw = Raw(box.url, box.keys["bad"])
        self.raw.session()
        self.sampler = self.raw.sampler()
        self._model: str | None = None

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.raw.model()
        return self._model

    def fresh(self) -> Ctx:
        self._model = None
        return self


@pytest.fixture()
def ctx(box) -> Ctx:
    return _cached(box, "ctx", lambda: Ctx(box)).fresh()


def raw_refused(raw: Raw, a, field: str | None, success_ok: bool = False) -> None:
    """A clean 4xx naming `field`, or an accepted request whose future fails as a user error
    naming it (`success_ok`: or one that just succeeds)."""
    if a.status is None:
        raise AssertionError(f"no answer: {a.error}")
    body = a.json if isinstance(a.json, dict) else {}
    if a.status == 200 and "request_id" in body:
        res = raw.poll(body["request_id"], NEXT_T)
        if res.status is None:
            raise AssertionError(f"accepted (HTTP 200) and its future never resolved: {res.error}")
        out = res.json if res.content_type.startswith("application/json") else None
        if isinstance(out, dict) and "error" in out:
            assert out.get("category") == "user", \
                f"accepted, then failed with category {out.get('category')!r}: {out['error'][:300]}"
            assert field is None or re.search(field, out["error"], re.I), \
                f"accepted, then failed without naming {field!r}: {out['error'][:300]}"
            return
        if success_ok:
            return
        raise AssertionError(f"accepted (HTTP 200), and it succeeded: "
                             f"{(res.text or repr(res.content))[:200]}")
    if a.status == 200:
        if success_ok:
            return
        raise AssertionError(f"accepted: {a.describe(200)}")
    assert is_clean_4xx(a.status), f"not a clean 4xx: {a.describe()}"
    if field is not None:
        detail = str(body.get("detail", ""))
        assert re.search(field, detail, re.I), f"the {a.status} does not name {field!r}: " \
                                               f"{a.describe()}"


def _sample(ctx: Ctx, **change) -> tuple:
    body = ctx.raw.sample_body(ctx.sampler)
    for k, v in change.items():
        if k in ("seed", "stop", "max_tokens"):
            body["sampling_params"][k] = v
        else:
            body[k] = v
    return "/asample", {"json": body}


def _create(ctx: Ctx, lora=None, **top) -> tuple:
    body = ctx.raw.create_model_body()
    if lora is not None:
        body["lora_config"] = lora
    body.update(top)
    return "/create_model", {"json": body}


def _optim(ctx: Ctx, seq_id=1, adam=None) -> tuple:
    return "/optim_step", {"json": {"model_id": ctx.model, "seq_id": seq_id,
                                    "adam_params": {"learning_rate": 1e-3} if adam is None
                                    else adam, "type": "optim_step"}}


def _sparse_csr(ctx: Ctx) -> tuple:
    m = pb()
    req = m.ForwardBackwardRequest(model_id=ctx.model, seq_id=1, loss_fn="cross_entropy")
    d = req.data.add()
    d.model_input.add().encoded_text.tokens = struct.pack("<3i", 5, 6, 7)
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype = m.DTYPE_INT64
    t.shape.extend([1, 100_000_000])
    t.sparse_csr.crow_indices = struct.pack("<2q", 0, 0)
    t.sparse_csr.col_indices = b""
    t.sparse_csr.values = b""
    return "/forward_backward", {"content": req.SerializeToString(),
                                 "headers": {"Content-Type": "application/x-protobuf"}}


def _zstd_bomb(ctx: Ctx) -> tuple:
    """A valid forward_backward (seq 1) plus an unknown 128 MiB field: ~4 KB compressed."""
    import zstandard

    size = 128 << 20
    tag = _varint((1000 << 3) | 2) + _varint(size)
    raw = fwdbwd_proto(ctx.model, 1) + tag + bytes(size)
    body = zstandard.ZstdCompressor(level=19).compress(raw)
    del raw
    assert len(body) < 8192, len(body)
    return "/forward_backward", {"content": body, "headers": {
        "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _nested(path: str, wrap: Callable[[str], str]) -> Callable:
    def build(ctx: Ctx) -> tuple:
        deep = "[" * 50_000 + "]" * 50_000
        return path, {"content": wrap(deep).encode(),
                      "headers": {"Content-Type": "application/json"}}
    return build


def _nested_prompt(deep: str) -> str:
    return '{"sampling_session_id": "x", "num_samples": 1, "prompt": ' + deep + "}"


@dataclass
class RawTrigger:
    build: Callable  # Ctx -> (path, httpx kwargs)
    field: str | None  # what the refusal must name (None: any clean 4xx will do)
    next: str  # "round@1" | "round@2" | "sample" | "model" | "session"
    success_ok: bool = False  # where accepting it is fine too (it must then just work)


RAW_TRIGGERS = {
    # sampling parameters
    "sample_seed_string": RawTrigger(lambda c: _sample(c, seed="abc"), r"seed", "sample"),
    "sample_seed_float": RawTrigger(lambda c: _sample(c, seed=1.5), r"seed", "sample"),
    "sample_seed_2_70": RawTrigger(lambda c: _sample(c, seed=2**70), r"seed", "sample"),
    "sample_max_tokens_2_64": RawTrigger(lambda c: _sample(c, max_tokens=2**64), r"max_tokens",
                                         "sample"),
    "sample_stop_float": RawTrigger(lambda c: _sample(c, stop=[1.5]), r"stop", "sample"),
    "sample_stop_nested_list": RawTrigger(lambda c: _sample(c, stop=[[1]]), r"stop", "sample"),
    "sample_stop_null": RawTrigger(lambda c: _sample(c, stop=[None]), r"stop", "sample"),
    "sample_num_samples_1e6": RawTrigger(lambda c: _sample(c, num_samples=10**6),
                                         r"num_samples", "sample"),
    "sample_num_samples_2_70": RawTrigger(lambda c: _sample(c, num_samples=2**70),
                                          r"num_samples", "sample"),
    "sample_sampling_params_string": RawTrigger(lambda c: _sample(c, sampling_params="abc"),
                                                r"sampling_params", "sample"),
    "sample_prompt_chunks_dict": RawTrigger(
        lambda c: _sample(c, prompt={"chunks": {"type": "encoded_text", "tokens": [5]}}),
        r"prompt|chunks", "sample"),
    "sample_prompt_token_2_64": RawTrigger(
        lambda c: _sample(c, prompt={"chunks": [{"type": "encoded_text", "tokens": [5, 2**64]}]}),
        r"token|prompt", "sample"),
    "sample_prompt_token_2_70": RawTrigger(
        lambda c: _sample(c, prompt={"chunks": [{"type": "encoded_text", "tokens": [5, 2**70]}]}),
        r"token|prompt", "sample"),
    # an asample seq_id is only an id in the answer: refusing or accepting it are both fine
    "sample_seq_id_2_64": RawTrigger(lambda c: _sample(c, seq_id=2**64), r"seq_id", "sample",
                                     success_ok=True),
    "sample_seq_id_2_70": RawTrigger(lambda c: _sample(c, seq_id=2**70), r"seq_id", "sample",
                                     success_ok=True),
    # create_model
    "create_model_lora_seed_string": RawTrigger(lambda c: _create(c, {"rank": 4, "seed": "abc"}),
                                                r"seed", "model"),
    "create_model_lora_seed_float": RawTrigger(lambda c: _create(c, {"rank": 4, "seed": 1.5}),
                                               r"seed", "model"),
    "create_model_lora_seed_2_70": RawTrigger(lambda c: _create(c, {"rank": 4, "seed": 2**70}),
                                              r"seed", "model"),
    "create_model_rank_1_7": RawTrigger(lambda c: _create(c, {"rank": 1.7}), r"rank", "model"),
    "create_model_rank_string": RawTrigger(lambda c: _create(c, {"rank": "x"}), r"rank", "model"),
    "create_model_trains_no_module": RawTrigger(lambda c: _create(c, {
        "rank": 4, "train_attn": False, "train_mlp": False, "train_unembed": False}),
        r"train_attn", "model"),
    "create_model_lora_config_string": RawTrigger(lambda c: _create(c, "abc"), r"lora_config",
                                                  "model"),
    "create_model_alpha_inf": RawTrigger(
        lambda c: _create(c, user_metadata={"twinkle.lora_alpha": "inf"}), r"alpha", "model"),
    "create_model_user_metadata_list": RawTrigger(lambda c: _create(c, user_metadata=[1]),
                                                  r"user_metadata", "model"),
    "create_model_optimizer_config_string": RawTrigger(
        lambda c: _create(c, optimizer_config="adamw"), r"optimizer_config", "model"),
    # optim_step
    "optim_step_learning_rate_string": RawTrigger(
        lambda c: _optim(c, adam={"learning_rate": "x"}), r"learning_rate", "round@2"),
    "optim_step_adam_params_list": RawTrigger(lambda c: _optim(c, adam=[1]), r"adam_params",
                                              "round@2"),
    "optim_step_seq_id_2_64": RawTrigger(lambda c: _optim(c, seq_id=2**64), r"seq_id", "round@1"),
    "optim_step_seq_id_2_70": RawTrigger(lambda c: _optim(c, seq_id=2**70), r"seq_id", "round@1"),
    # forward_backward protobuf bodies
    "forward_backward_sparse_csr_1e8": RawTrigger(
        _sparse_csr, r"shape|sparse|target_tokens|loss_fn_inputs|size|large", "round@2"),
    "forward_backward_zstd_bomb_128MiB": RawTrigger(_zstd_bomb, None, "round@1"),
    # bodies
    "create_session_json_nested_50k": RawTrigger(_nested("/create_session", lambda d: d), None,
                                                 "session"),
    "asample_json_nested_50k": RawTrigger(_nested("/asample", _nested_prompt), None, "sample"),
    "create_session_user_metadata_60MB": RawTrigger(
        lambda c: ("/create_session", {"json": {"user_metadata": {"x": "a" * 60_000_000},
                                                "sdk_version": "0.38.0"}}),
        None, "session"),
}


def raw_next(ctx: Ctx, kind: str) -> None:
    raw = ctx.raw
    if kind.startswith("round@"):
        raw.round(ctx.model, int(kind[6:]))
    elif kind == "sample":
        raw.sample(ctx.sampler)
    elif kind == "model":
        raw.round(raw.model(timeout=NEXT_T), 1)
    elif kind == "session":
        a = raw.post("/create_session", {"user_metadata": {}, "sdk_version": "0.38.0"})
        assert a.status == 200, f"create_session: {a.describe()}"
    else:
        raise ValueError(kind)


@pytest.mark.parametrize("name", list(RAW_TRIGGERS))
def test_raw_trigger(name, box, good, ctx):
    trig = RAW_TRIGGERS[name]
    path, kw = trig.build(ctx)

    def bad_request():
        answer = ctx.raw.post(path, timeout=NEXT_T, **kw)
        kw.clear()  # the big bodies
        raw_refused(ctx.raw, answer, trig.field, trig.success_ok)

    isolate(box, good, bad_request, lambda: raw_next(ctx, trig.next))


def test_raw_save_weights_ttl_1e300(box, good, ctx):
    """Refused naming ttl_seconds; the tenant's listings still answer."""
    raw, model = ctx.raw, ctx.model

    def bad_request():
        a = raw.post("/save_weights", {"model_id": model, "seq_id": 1, "path": "ttl",
                                       "ttl_seconds": 1e300, "type": "save_weights"},
                     timeout=NEXT_T)
        raw_refused(raw, a, r"ttl")  # max_ttl_s: never saved

    def listings(checks: Checks) -> None:
        for path in (f"/training_runs/{model}/checkpoints", "/checkpoints",
                     f"/training_runs/{model}", "/training_runs"):
            a = raw.get(path)
            if a.status != 200:
                checks.add(f"GET {path} afterwards: {a.describe()}")

    isolate(box, good, bad_request, lambda: raw_next(ctx, "round@2"), listings)


def test_raw_sample_max_tokens_0(box, good, ctx):
    """max_tokens 0: refused naming max_tokens, or honoured (no token sampled); never 16."""
    raw = ctx.raw

    def bad_request():
        path, kw = _sample(ctx, max_tokens=0)
        a = raw.post(path, timeout=NEXT_T, **kw)
        if a.status == 200 and isinstance(a.json, dict) and "request_id" in a.json:
            res = raw.poll(a.json["request_id"], NEXT_T)
            if res.status == 200 and res.content_type.startswith("application/x-protobuf"):
                lengths = [len(s) for s in sample_tokens(res.content)]
                assert lengths == [0], f"max_tokens 0 sampled {lengths} tokens"
                return
        raw_refused(raw, a, r"max_tokens")

    isolate(box, good, bad_request, lambda: raw_next(ctx, "sample"))


# -- acknowledged steps survive a worker kill ---------------------------------------------------

TEXT_SETS = [
    ["the sun and the sea are big.", "blue green red"],
    ["a cat sat on the mat.", "one two three four five six"],
    ["hello world from twinkle, yes.", "the old man and the sea."],
    ["seven eight nine ten.", "water is wet and fire is hot."],
]
LRS = [5e-3, 1e-2, 2e-3, 8e-3]
EVAL = ["the sun and the sea are big.", "a cat sat on the mat.", "hello world, seven eight."]


@dataclass
class Pair:
    fb: str  # "ok" | "failed: <message>" | "hang"
    opt: str


def _outcome(fut, timeout: float = T) -> str:
    try:
        fut.result(timeout=timeout)
        return "ok"
    except TimeoutError:
        cancel(fut)
        return "hang"
    except tinker.RequestFailedError as e:
        return f"failed ({e.category}): {e.message.removeprefix('Request failed: ')[:200]}"
    except Exception as e:  # noqa: BLE001
        return f"raised {type(e).__name__}: {str(e)[:200]}"


def _resubmit_error(outcome: str) -> bool:
    return outcome.startswith("failed (") and re.search(
        r"again|resubmit|retry|restart", outcome, re.I) is not None


def _train(t: Tenant, stop: threading.Event, log: list[Pair]) -> None:
    """Pipelined like a real script: forward_backward and optim_step sent back to back."""
    while not stop.is_set():
        fb = t.tc.forward_backward(t.data, "cross_entropy")
        opt = t.tc.optim_step(types.AdamParams(learning_rate=t.lr))
        pair = Pair(_outcome(fb), _outcome(opt))
        log.append(pair)
        if pair.fb != "ok" or pair.opt != "ok":
            return


def _eval_loss(tc, data) -> float:
    return wait(tc.forward(data, "cross_entropy"), "forward on the fixed batch").metrics["loss:sum"]


def test_worker_kill_keeps_every_acknowledged_step(box, tiny_dir):
    checks = Checks()
    trainers = [Tenant(box, f"k{i + 1}", tiny_dir.name, seed=100 + i, lr=LRS[i],
                       texts=TEXT_SETS[i]) for i in range(4)]
    evals = make_data(trainers[0].tok, EVAL)
    logs: list[list[Pair]] = [[] for _ in trainers]
    stop = threading.Event()
    threads = [threading.Thread(target=_train, args=(t, stop, log), daemon=True)
               for t, log in zip(trainers, logs, strict=True)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
            sum(p.fb == p.opt == "ok" for p in log) >= 3 for log in logs):
        if not any(th.is_alive() for th in threads):
            break
        time.sleep(0.02)
    acked_before = [sum(p.fb == p.opt == "ok" for p in log) for log in logs]
    assert all(n >= 3 for n in acked_before), \
        f"the tenants did not reach 3 acknowledged steps each before the kill: {logs}"

    old = box.d.workers()
    assert len(old) == 1, old
    os.kill(old[0], signal.SIGKILL)  # mid-training: the four clients are looping
    stop.set()
    for th in threads:
        th.join(timeout=2 * T + 10)
    assert not any(th.is_alive() for th in threads), "a training thread did not finish"
    box.d.wait_workers(1, old=set(old))
    box.take_trips()

    control_sc = tinker.ServiceClient(base_url=box.url, api_key=box.keys["control"])
    for t, log in zip(trainers, logs, strict=True):
        for i, p in enumerate(log):
            for what, outcome in (("forward_backward", p.fb), ("optim_step", p.opt)):
                if outcome != "ok" and not _resubmit_error(outcome):
                    checks.add(f"{t.name} pair {i} {what}: {outcome} (allowed: success, or a "
                               "clear error telling the user to submit it again)")
        got = checks.check(f"{t.name} forward after the restart", _eval_loss, t.tc, evals)
        # The control: the same adapter (same seed), trained alone with exactly the
        # acknowledged requests, in order.
        ctl = Tenant(box, "control", tiny_dir.name, seed=t.seed, lr=t.lr, texts=[], sc=control_sc)
        by_step = [_eval_loss(ctl.tc, evals)]  # the control's loss after 0, 1, 2 ... steps
        for p in log:
            if p.fb == "ok":
                wait(ctl.tc.forward_backward(t.data, "cross_entropy"), "control forward_backward")
            if p.opt == "ok":
                wait(ctl.tc.optim_step(types.AdamParams(learning_rate=t.lr)), "control optim_step")
                by_step.append(_eval_loss(ctl.tc, evals))
        want = by_step[-1]
        if got is not None and not math.isclose(got, want, rel_tol=1e-4):
            at = [i for i, v in enumerate(by_step) if math.isclose(got, v, rel_tol=1e-4)]
            where = (f"it is the control's loss after {at[0]} step(s): rolled back "
                     f"{len(by_step) - 1 - at[0]}" if at else "it matches no step of the control")
            checks.add(f"{t.name}: loss {got:.6f} after the restart != {want:.6f} of the control "
                       f"trained with its {len(by_step) - 1} acknowledged optim_steps; {where} "
                       f"(last pairs: {[(p.fb[:70], p.opt[:70]) for p in log[-2:]]})")
    checks.done()
