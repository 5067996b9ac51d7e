"""Issue 11: a seeded fuzzer against a real daemon.

It takes valid Tinker requests (JSON bodies, the forward_backward protobuf, the REST GETs with
their query strings) and sends a few thousand random mutations of them: a field's type
changed (str/int/float/bool/null/list/dict, huge ints, NaN and Infinity), fields deleted,
duplicated, renamed or added, huge sizes (long strings, long lists, many keys), deep nesting
(up to 50k), wrong content types and encodings, truncated or random bytes.

Then: no answer is a 5xx (every offender is listed, with its body cut to 300 characters), no
request goes unanswered, the worker group never restarted, the daemon's RSS grew by less than
200 MB, and a good tenant still trains.

random.Random(0): the same mutations on every run.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import random
import struct
import time
import warnings
from dataclasses import dataclass, field

import pytest
from hostile import Box, Checks, Raw, T, fwdbwd_proto, pb, rss_mb

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

N_MUTATIONS = 3000
WORK_CAP_S = 150  # bounded work on a slow machine (the count sent is reported); no assertion
REQUEST_TIMEOUT = 15  # an answer should take milliseconds
MAX_DAEMON_RESTARTS = 2  # after that the fuzz stops and reports what it found
MAX_RSS_GROWTH_MB = 200
SEQ_PER_MODEL = 40  # seq_id-carrying mutations go to a fresh model every this many


# -- values and JSON --------------------------------------------------------------------------


class Deep:
    """A JSON value nested `n` deep ([[[...]]]), written without recursion."""

    def __init__(self, n: int):
        self.n = n

    def __repr__(self):
        return f"Deep({self.n})"


class Dup(dict):
    """A JSON object that repeats `key` (first with `value`, then the dict's own)."""

    def __init__(self, base: dict, key: str, value):
        super().__init__(base)
        self.dup = (key, value)


def dumps(v) -> str:
    """JSON text, with NaN/Infinity literals, Deep values and duplicated keys."""
    if isinstance(v, Deep):
        return "[" * v.n + "]" * v.n
    if isinstance(v, dict):
        items = [f"{json.dumps(str(k))}: {dumps(x)}" for k, x in v.items()]
        if isinstance(v, Dup):
            items.insert(0, f"{json.dumps(v.dup[0])}: {dumps(v.dup[1])}")
        return "{" + ", ".join(items) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(dumps(x) for x in v) + "]"
    return json.dumps(v)  # allow_nan: NaN, Infinity, -Infinity


def _label(v) -> str:
    if isinstance(v, str):
        return f"str[{len(v)}]" if len(v) > 20 else repr(v)
    if isinstance(v, list):
        return f"list[{len(v)}]" if len(v) > 4 else repr(v)[:40]
    if isinstance(v, dict):
        return f"dict[{len(v)}]" if len(v) > 3 else repr(v)[:40]
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 10**6:
        return f"int({'-' if v < 0 else ''}2**{abs(v).bit_length() - 1}..)"
    return repr(v)


def weird(rng: random.Random):
    """A value of a random type, size or range."""
    return rng.choice(WEIRD)(rng)


WEIRD = [
    lambda r: "", lambda r: "abc", lambda r: "NaN", lambda r: "Infinity", lambda r: "-1",
    lambda r: "1e309", lambda r: "\u0000", lambda r: "../../x", lambda r: "a/b",
    lambda r: "é✓\U0001f600", lambda r: "x" * r.choice([256, 4096, 100_000]),
    lambda r: 0, lambda r: -1, lambda r: 1, lambda r: 2**31, lambda r: 2**53 + 1,
    lambda r: 2**63, lambda r: 2**64, lambda r: 2**70, lambda r: -(2**63) - 1,
    lambda r: 10**6, lambda r: 10**30,
    lambda r: 1.5, lambda r: -0.0, lambda r: 1e300, lambda r: -1e300, lambda r: 5e-324,
    lambda r: float("nan"), lambda r: float("inf"), lambda r: float("-inf"),
    lambda r: True, lambda r: False, lambda r: None,
    lambda r: [], lambda r: {}, lambda r: [None], lambda r: [1, "a", None, 2.5],
    lambda r: {"a": 1}, lambda r: {"": None},
    lambda r: [r.randint(-5, 5000) for _ in range(r.choice([100, 10_000]))],
    lambda r: ["x"] * r.choice([1000, 10_000]),
    lambda r: Deep(r.choice([10, 1000, 50_000])),
    lambda r: {f"k{i}": i for i in range(r.choice([100, 5000]))},
]


def _slots(v, path="$"):
    """(container, key, path) of every value inside v (not inside huge values)."""
    if isinstance(v, dict) and len(v) <= 50:
        for k in list(v):
            yield v, k, f"{path}.{k}"
            yield from _slots(v[k], f"{path}.{k}")
    elif isinstance(v, list) and len(v) <= 50:
        for i in range(len(v)):
            yield v, i, f"{path}[{i}]"
            yield from _slots(v[i], f"{path}[{i}]")


def _dicts(v, path="$"):
    if isinstance(v, dict) and len(v) <= 50:
        yield v, path
        for k, x in v.items():
            yield from _dicts(x, f"{path}.{k}")
    elif isinstance(v, list) and len(v) <= 50:
        for i, x in enumerate(v):
            yield from _dicts(x, f"{path}[{i}]")


def mutate_json(body: dict, rng: random.Random) -> tuple[object, list[str]]:
    """1 to 3 structural mutations of a JSON body; returns it and what was done."""
    body = copy.deepcopy(body)
    done: list[str] = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        op = rng.choice(["replace"] * 5 + ["delete", "add", "dup", "rename", "root"])
        slots = list(_slots(body))
        if op == "root" or not slots:
            body = weird(rng)
            done.append(f"body={_label(body)}")
            break
        if op == "replace":
            c, k, p = rng.choice(slots)
            c[k] = weird(rng)
            done.append(f"{p}={_label(c[k])}")
        elif op == "delete":
            c, k, p = rng.choice(slots)
            c.pop(k)
            done.append(f"del {p}")
        elif op == "add":
            d, p = rng.choice(list(_dicts(body)) or [(body, "$")])
            name = rng.choice(["extra", "seq_id", "type", "model_id", "__proto__", "x" * 300])
            d[name] = weird(rng)
            done.append(f"add {p}.{name[:20]}={_label(d[name])}")
        elif op == "dup" and isinstance(body, dict) and body:
            key = rng.choice(list(body))
            value = weird(rng)
            body = Dup(body, key, value)
            done.append(f"dup $.{key}={_label(value)}")
        elif op == "rename":
            dicts = [(d, p) for d, p in _dicts(body) if d]
            if dicts:
                d, p = rng.choice(dicts)
                k = rng.choice(list(d))
                new = rng.choice([k.upper(), k + "_", "", k[:-1]])
                d[new] = d.pop(k)
                done.append(f"rename {p}.{k}->{new!r}")
    return body, done


# -- bytes, encodings, content types ------------------------------------------------------------


def mutate_bytes(data: bytes, headers: dict, rng: random.Random) -> tuple[bytes, dict, str]:
    """A body-level mutation: content type, encoding, truncation, random bytes ..."""
    import zstandard

    headers = dict(headers)
    op = rng.choice(["ctype", "gzip", "zstd", "zstd_garbage", "encoding_lie", "truncate",
                     "flip", "random", "empty", "bom", "bad_utf8", "whitespace", "zstd_big"])
    if op == "ctype":
        headers["Content-Type"] = rng.choice([
            "text/plain", "application/x-protobuf", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x", "", "application/json; charset=latin-1",
            "application/json; charset=utf-16", "application/json"])
    elif op == "gzip":
        data, headers["Content-Encoding"] = gzip.compress(data), "gzip"
    elif op == "zstd":
        data, headers["Content-Encoding"] = zstandard.ZstdCompressor().compress(data), "zstd"
    elif op == "zstd_big":  # a small body that inflates to 8 MiB of padding
        pad = data + b" " * (8 << 20) if not headers.get("Content-Type", "").endswith(
            "protobuf") else data + _unknown_field(8 << 20)
        data, headers["Content-Encoding"] = zstandard.ZstdCompressor().compress(pad), "zstd"
    elif op == "zstd_garbage":
        data, headers["Content-Encoding"] = b"\x28\xb5\x2f\xfd" + rng.randbytes(40), "zstd"
    elif op == "encoding_lie":
        headers["Content-Encoding"] = rng.choice(["gzip", "br", "deflate", "zstd", "x-nope",
                                                  "gzip, zstd"])
    elif op == "truncate":
        data = data[: rng.randint(0, max(0, len(data) - 1))]
    elif op == "flip":
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
        data = bytes(b)
    elif op == "random":
        data = rng.randbytes(rng.choice([1, 16, 300, 5000]))
    elif op == "empty":
        data = b""
    elif op == "bom":
        data = b"\xef\xbb\xbf" + data
    elif op == "bad_utf8":
        cut = rng.randint(0, len(data))
        data = data[:cut] + b"\xff\xfe\xc3" + data[cut:]
    elif op == "whitespace":
        data = b" " * (1 << 20) + data
    return data, headers, f"bytes:{op}"


def _unknown_field(size: int) -> bytes:
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            b, n = n & 0x7F, n >> 7
            out.append(b | (0x80 if n else 0))
            if not n:
                return bytes(out)
    return varint((1000 << 3) | 2) + varint(size) + bytes(size)


# -- the forward_backward protobuf --------------------------------------------------------------


def mutate_proto(model: str, seq: int, sid: str, rng: random.Random) -> tuple[bytes, list[str]]:
    """A ForwardBackwardRequest with 1 to 3 mutations of its fields."""
    m = pb()
    req = m.ForwardBackwardRequest.FromString(fwdbwd_proto(model, seq))
    done: list[str] = []

    def datum():
        return req.data[0] if req.data else req.data.add()

    def tensor(name="target_tokens"):
        return datum().loss_fn_inputs[name]

    for _ in range(rng.choice([1, 1, 2, 3])):
        op = rng.choice(["seq_id", "model_id", "loss_fn", "forward_only", "tokens", "odd_bytes",
                         "dtype", "shape", "targets", "sparse", "extra_input", "chunk",
                         "config", "config_v2", "datums", "spans", "float_targets"])
        if op == "seq_id":
            req.seq_id = rng.choice([0, -1, 2**31 - 1, -(2**31), seq + 1000, max(seq - 1, 0)])
            done.append(f"seq_id={req.seq_id}")
        elif op == "model_id":
            req.model_id = rng.choice(["", "nope", f"{sid}:train:999", "x" * 10_000,
                                       model + ":x", sid, "sess-0:train:0", "\u0000"])
            done.append(f"model_id={_label(req.model_id)}")
        elif op == "loss_fn":
            req.loss_fn = rng.choice(["", "nope", "ppo", "cispo", "importance_sampling", "dro",
                                      "x" * 5000, "cross_entropy\u0000", "CROSS_ENTROPY"])
            done.append(f"loss_fn={_label(req.loss_fn)}")
        elif op == "forward_only":
            req.forward_only = True
            done.append("forward_only")
        elif op == "tokens":
            toks = rng.choice([[], [-1], [2**31 - 1], [10**6], list(range(5000)), [5] * 100_000])
            chunk = datum().model_input[0] if datum().model_input else datum().model_input.add()
            chunk.encoded_text.tokens = struct.pack(f"<{len(toks)}i", *toks)
            done.append(f"tokens={_label(toks)}")
        elif op == "odd_bytes":
            chunk = datum().model_input[0] if datum().model_input else datum().model_input.add()
            chunk.encoded_text.tokens = rng.randbytes(rng.choice([1, 3, 7]))
            done.append("tokens=odd bytes")
        elif op == "dtype":
            tensor().dtype = rng.choice([0, 1, 3, 4, 7, 2**20])
            done.append(f"dtype={tensor().dtype}")
        elif op == "shape":
            shape = rng.choice([[], [0], [-1], [2**62], [1, 100_000_000], [4, 2], [3, 3, 3],
                                [2**31, 2**31]])
            del tensor().shape[:]
            tensor().shape.extend(shape)
            done.append(f"shape={shape}")
        elif op == "targets":
            vals = rng.choice([[], [6], [6, 7, 8, 9, 10, 11], [-5, 2**40, 7, 8], [9] * 50_000])
            tensor().dense = struct.pack(f"<{len(vals)}q", *vals)
            del tensor().shape[:]
            tensor().shape.append(len(vals))
            done.append(f"targets={_label(vals)}")
        elif op == "sparse":
            t = tensor()
            del t.shape[:]
            rows, cols = rng.choice([(1, 4), (1, 100_000_000), (2, 2), (0, 0), (4, 1)])
            t.shape.extend([rows, cols])
            t.sparse_csr.crow_indices = struct.pack(
                "<3q", *rng.choice([(0, 1, 2), (0, 5, 1), (0, 0, 0), (-1, 0, 1)]))
            t.sparse_csr.col_indices = struct.pack("<2q", *rng.choice([(0, 1), (9, 2**40)]))
            t.sparse_csr.values = struct.pack("<2q", 6, 7)
            done.append(f"sparse_csr shape=[{rows}, {cols}]")
        elif op == "extra_input":
            name = rng.choice(["weights", "advantages", "logprobs", "foo", "", "x" * 1000])
            n = rng.choice([4, 3, 0, 10_000])
            val = rng.choice([float("nan"), float("inf"), 1.0, -1e38])
            t = tensor(name)
            t.dtype = m.DTYPE_FLOAT32
            t.dense = struct.pack(f"<{n}f", *([val] * n))
            t.shape.append(n)
            done.append(f"loss_fn_inputs[{name[:10]!r}]={n}x{val}")
        elif op == "chunk":
            kind = rng.choice(["image", "dmel", "empty"])
            c = datum().model_input.add()
            if kind == "image":
                c.image.data, c.image.format, c.image.expected_tokens = b"\x89PNG", "png", 2
            elif kind == "dmel":
                c.dmel.dmel = b"\x00" * 8
            done.append(f"chunk={kind}")
        elif op == "config":
            key = rng.choice(["clip_low_threshold", "beta", "", "x" * 500])
            req.loss_fn_config[key] = rng.choice([float("nan"), float("inf"), -1e308, 0.5])
            done.append(f"loss_fn_config[{key[:10]!r}]={req.loss_fn_config[key]}")
        elif op == "config_v2":
            v = req.loss_fn_config_v2["clip_low_threshold"]
            if rng.random() < 0.5:
                v.text = rng.choice(["abc", "", "x" * 10_000])
            else:
                v.number = rng.choice([float("nan"), 0.2])
            done.append("loss_fn_config_v2")
        elif op == "datums":
            k = rng.choice([0, 3, 300])
            one = req.data[0] if req.data else None
            del req.data[:]
            for _ in range(k):
                d = req.data.add()
                if one is not None:
                    d.CopyFrom(one)
            done.append(f"{k} datums")
        elif op == "spans":
            s = datum().model_input_spans.add()
            s.prompt_tokens.sequence_id = "x"
            s.prompt_tokens.offset = rng.choice([-1, 2**62, 0])
            s.prompt_tokens.length = rng.choice([-5, 2**62, 3])
            done.append("model_input_spans")
        elif op == "float_targets":
            t = tensor()
            t.dtype = m.DTYPE_FLOAT32
            t.dense = struct.pack("<4f", 6.5, float("nan"), 8.0, 9.0)
            done.append("target_tokens float32")
    return req.SerializeToString(), done


# -- the valid requests ----------------------------------------------------------------------


@dataclass
class Req:
    template: str
    method: str
    path: str
    body: object = None  # JSON value (dumped with dumps) ...
    content: bytes | None = None  # ... or raw bytes
    headers: dict = field(default_factory=dict)
    params: list | None = None
    done: list = field(default_factory=list)

    def data(self) -> bytes | None:
        if self.content is not None:
            return self.content
        if self.body is None:
            return None
        return dumps(self.body).encode("utf-8", "surrogatepass")

    def describe(self, n: int = 300) -> str:
        data = self.data()
        shown = repr(data[:n]) if data is not None else ""
        q = f"?{self.params}"[:120] if self.params else ""
        return (f"{self.method} {self.path[:120]}{q} [{self.template}: "
                f"{'; '.join(self.done)[:200]}] {shown}")


class Targets:
    """The fuzz tenant's objects, made with valid requests: the things the mutations aim at."""

    def __init__(self, box: Box, base_model: str):
        self.base_model = base_model
        raw = self.raw = Raw(box.url, box.keys["fuzz"], timeout=REQUEST_TIMEOUT)
        raw.base_model = base_model
        self.sid = raw.session()
        self.model = raw.model()
        self.seq = 1
        save = raw.post("/save_weights", {"model_id": self.model, "seq_id": 1, "path": "base",
                                          "type": "save_weights"})
        self.done_request = save.json["request_id"]
        self.ckpt = raw.result(save, "save_weights").json["path"]
        samp = raw.post("/save_weights_for_sampler", {"model_id": self.model, "seq_id": 2,
                                                      "path": "samp"})
        self.sampler_ckpt = raw.result(samp, "save_weights_for_sampler").json["path"]
        raw.result(raw.post("/save_weights", {"model_id": self.model, "seq_id": 3,
                                              "path": "ttl-target"}), "save_weights")
        self.seq, self.in_model = 4, 3
        self.sampler = raw.sampler()
        self.counter = 0  # unique names and seq ids

    def next_seq(self) -> tuple[str, int]:
        """The current model and its next seq_id; a fresh model every SEQ_PER_MODEL."""
        if self.in_model >= SEQ_PER_MODEL:
            a = self.raw.post("/create_model", self.raw.create_model_body())
            if a.status == 200 and isinstance(a.json, dict) and "model_id" in a.json:
                self.model, self.seq, self.in_model = a.json["model_id"], 1, 0
        self.seq, self.in_model = self.seq + 1, self.in_model + 1
        return self.model, self.seq - 1

    def unique(self) -> int:
        self.counter += 1
        return self.counter

    def valid(self, rng: random.Random) -> Req:
        """One valid request, of a random kind."""
        kind = rng.choice(TEMPLATES)
        return getattr(self, f"t_{kind}")(rng)

    # -- JSON templates -----------------------------------------------------------------

    def t_create_session(self, rng):
        return Req("create_session", "POST", "/create_session", {
            "tags": ["a"], "user_metadata": {"k": "v"}, "sdk_version": "0.38.0",
            "project_id": "p", "type": "create_session"})

    def t_create_model(self, rng):
        body = self.raw.create_model_body(rank=4)
        body["lora_config"].update(seed=1, train_mlp=True, train_attn=True, train_unembed=True)
        body["user_metadata"] = {"twinkle.lora_alpha": "16"}
        body["optimizer_config"] = {"type": "adamw"}
        return Req("create_model", "POST", "/create_model", body)

    def t_optim_step(self, rng):
        model, seq = self.next_seq()
        return Req("optim_step", "POST", "/optim_step", {
            "model_id": model, "seq_id": seq, "type": "optim_step",
            "adam_params": {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                            "weight_decay": 0.0, "grad_clip_norm": 0.0}})

    def t_save_weights(self, rng):
        model, seq = self.next_seq()
        return Req("save_weights", "POST", "/save_weights", {
            "model_id": model, "seq_id": seq, "path": f"ck-{self.unique()}",
            "ttl_seconds": 3600, "type": "save_weights"})

    def t_save_weights_for_sampler(self, rng):
        model, seq = self.next_seq()
        body = {"model_id": model, "seq_id": seq, "type": "save_weights_for_sampler"}
        if rng.random() < 0.5:
            body["path"] = f"s-{self.unique()}"
        else:
            body["sampling_session_seq_id"] = 1000 + self.unique()
        return Req("save_weights_for_sampler", "POST", "/save_weights_for_sampler", body)

    def t_load_weights(self, rng):
        if rng.random() < 0.5:
            model, seq = self.next_seq()
            body = {"model_id": model, "seq_id": seq, "path": self.ckpt, "optimizer": True}
        else:  # create-via-load (SDK 0.38)
            body = {"session_id": self.sid, "model_seq_id": self.raw.model_seq,
                    "path": self.ckpt, "optimizer": False}
            self.raw.model_seq += 1
        body["type"] = "load_weights"
        return Req("load_weights", "POST", "/load_weights", body)

    def t_create_sampling_session(self, rng):
        body = {"session_id": self.sid, "sampling_session_seq_id": 5000 + self.unique(),
                "type": "create_sampling_session"}
        if rng.random() < 0.5:
            body["base_model"] = self.base_model
        else:
            body["model_path"] = self.sampler_ckpt
        return Req("create_sampling_session", "POST", "/create_sampling_session", body)

    def t_asample(self, rng):
        body = self.raw.sample_body(self.sampler, tokens=(5, 6, 7), top_k=-1, top_p=1.0, seed=3,
                                    stop=[7])
        body["prompt_logprobs"] = False
        return Req("asample", "POST", "/asample", body)

    def t_retrieve_future(self, rng):
        return Req("retrieve_future", "POST", "/retrieve_future", {
            "request_id": self.done_request, "allow_metadata_only": False})

    def t_get_info(self, rng):
        return Req("get_info", "POST", "/get_info", {"model_id": self.model, "type": "get_info"})

    def t_weights_info(self, rng):
        return Req("weights_info", "POST", "/weights_info", {"tinker_path": self.ckpt})

    def t_heartbeat(self, rng):
        return Req("session_heartbeat", "POST", "/session_heartbeat", {
            "session_id": self.sid, "type": "session_heartbeat"})

    def t_client_config(self, rng):
        return Req("client_config", "POST", "/client/config", {"sdk_version": "0.38.0"})

    def t_set_ttl(self, rng):
        return Req("set_ttl", "PUT",
                   f"/training_runs/{self.ckpt.split('/')[2]}/checkpoints/weights/ttl-target/ttl",
                   {"ttl_seconds": 3600})

    # -- the protobuf -------------------------------------------------------------------

    def t_forward_backward(self, rng):
        model, seq = self.next_seq()
        return Req("forward_backward", "POST", "/forward_backward",
                   content=fwdbwd_proto(model, seq),
                   headers={"Content-Type": "application/x-protobuf"})

    # -- REST GETs ----------------------------------------------------------------------

    def t_rest(self, rng):
        run = self.ckpt.split("/")[2]
        path, params = rng.choice([
            ("/training_runs", [("offset", "0"), ("limit", "5")]),
            ("/checkpoints", [("offset", "0"), ("limit", "5")]),
            ("/sessions", [("offset", "0"), ("limit", "5")]),
            (f"/training_runs/{run}", []),
            (f"/training_runs/{run}/checkpoints", []),
            (f"/sessions/{self.sid}", []),
            (f"/samplers/{self.sampler}", []),
            ("/get_server_capabilities", []),
        ])
        return Req("rest", "GET", path, params=params)


TEMPLATES = ["create_session", "create_model", "optim_step", "save_weights",
             "save_weights_for_sampler", "load_weights", "create_sampling_session", "asample",
             "asample", "retrieve_future", "get_info", "weights_info", "heartbeat",
             "client_config", "set_ttl", "forward_backward", "forward_backward",
             "forward_backward", "rest", "rest"]

ODD_QUERY = ["-1", "abc", "", "1e3", "99999999999999999999999", "2147483648", "NaN", "0x10",
             "1.5", " 1", "%00", "x" * 5000, "[]", "1,2", "inf"]
ODD_SEGMENT = ["..", "%2e%2e", "x" * 5000, "\u00e9", "%00", "a%2Fb", "sess-0:train:0",
               "tinker:%2F%2Fx", " ", "null"]


def mutate(req: Req, t: Targets, rng: random.Random) -> Req:
    """A random mutation of a valid request."""
    if req.method == "GET":
        params = list(req.params or [])
        op = rng.choice(["value", "value", "extra", "dup", "segment", "drop"])
        if op == "value" and params:
            i = rng.randrange(len(params))
            params[i] = (params[i][0], rng.choice(ODD_QUERY))
        elif op == "dup" and params:
            params.append((params[0][0], rng.choice(ODD_QUERY)))
        elif op == "extra":
            params.append((rng.choice(["offset", "limit", "cursor", "x"]), rng.choice(ODD_QUERY)))
        elif op == "segment":
            parts = req.path.split("/")
            parts[-1] = rng.choice(ODD_SEGMENT)
            req.path = "/".join(parts)
        elif op == "drop":
            params = []
        req.params, req.done = params, [f"query:{op}"]
        return req
    if req.content is not None:  # the protobuf
        if rng.random() < 0.7:
            msg = pb().ForwardBackwardRequest.FromString(req.content)
            req.content, req.done = mutate_proto(msg.model_id, msg.seq_id, t.sid, rng)
        if rng.random() < 0.3 or not req.done:
            req.content, req.headers, what = mutate_bytes(req.content, req.headers, rng)
            req.done.append(what)
        return req
    if rng.random() < 0.8:
        req.body, req.done = mutate_json(req.body, rng)
    else:
        data = req.data()
        req.content, req.headers, what = mutate_bytes(
            data, {"Content-Type": "application/json"}, rng)
        req.done = [what]
    return req


# -- the test ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def box(tiny_dir, tmp_path_factory):
    b = Box(tiny_dir, tmp_path_factory.mktemp("fuzz"), "poll_seconds = 0.5\n", ("fuzz", "good"))
    yield b
    b.stop()


def _send(raw: Raw, req: Req):
    headers = dict(req.headers)
    data = req.data()
    if data is not None and req.content is None:
        headers.setdefault("Content-Type", "application/json")
    return raw.send(req.method, req.path, content=data, headers=headers, params=req.params,
                    timeout=REQUEST_TIMEOUT)


def _revive(box: Box) -> bool:
    """After a request got no answer: is the daemon still serving? Bring it back if not.
    True when it had to be restarted."""
    deadline = time.monotonic() + 10
    while box.alive() and box.d.health() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    if box.alive() and box.d.health() is not None:
        return False
    if box.alive():  # up but not answering (a blocked event loop): ours to stop
        box.d.proc.kill()
        box.d.proc.wait()
    box.ensure_up()
    return True


def _settle(box: Box, cap: float = 60) -> None:
    """Let the work the fuzz got accepted run (a crash it causes must show before the restart
    counter is read): wait until the queues stop shrinking (requests behind a seq_id gap
    never run) and the workers are up."""
    import re

    def depth() -> float | None:
        text = box.metrics_text()
        if text is None:
            return None
        return sum(float(v) for v in re.findall(r"^twinkle_queue_depth\{.*?\}\s+(\S+)$", text,
                                                re.M))

    deadline, last, same = time.monotonic() + cap, None, 0
    while time.monotonic() < deadline and same < 3:
        time.sleep(1.0)
        now = depth()
        same = same + 1 if now == last else 0
        last = now
    box.wait_healthy()


def _good_round(tc, data) -> None:
    fb = tc.forward_backward(data, "cross_entropy")
    opt = tc.optim_step(tinker.types.AdamParams(learning_rate=1e-3))
    for f, what in ((fb, "forward_backward"), (opt, "optim_step")):
        try:
            f.result(timeout=T)
        except TimeoutError:
            raise AssertionError(f"the good tenant's {what}: no answer in {T} s") from None


def test_fuzz_no_5xx_no_restart_no_memory_growth(box, tiny_dir):
    rng = random.Random(0)
    checks = Checks()
    sc = tinker.ServiceClient(base_url=box.url, api_key=box.keys["good"])
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4, seed=0).result(timeout=T)
    tok = tc.get_tokenizer()
    ids = tok("the sun and the sea are big.").input_ids
    data = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]})]
    _good_round(tc, data)

    t = Targets(box, tiny_dir.name)
    for kind in TEMPLATES:  # every valid request once: warm code paths before measuring
        a = _send(t.raw, getattr(t, f"t_{kind}")(rng))
        assert a.status is not None and a.status < 400, f"valid {kind}: {a.describe()}"
    time.sleep(1.0)
    generation, rss0, restarts0 = box.generation, rss_mb(box.pid), box.restarts()

    offenders: dict[tuple, list] = {}  # (template, status, first op) -> [count, example]
    sent, daemon_restarts, started = 0, 0, time.monotonic()
    while sent < N_MUTATIONS and time.monotonic() - started < WORK_CAP_S:
        req = mutate(t.valid(rng), t, rng)
        a = _send(t.raw, req)
        sent += 1
        if a.status is not None and a.status < 500:
            continue
        status = a.status or "no answer"
        key = (req.template, status, (req.done or ["?"])[0].split("=")[0])
        entry = offenders.setdefault(key, [0, f"{status}: {req.describe()} -> "
                                              f"{a.describe(150)}"])
        entry[0] += 1
        if a.status is None and _revive(box):
            daemon_restarts += 1
            offenders[key][1] += " [the daemon was dead or stuck: restarted]"
            if daemon_restarts > MAX_DAEMON_RESTARTS:
                checks.add(f"stopped after {sent} mutations: the daemon had to be restarted "
                           f"{daemon_restarts} times")
                break
            t = Targets(box, tiny_dir.name)
    elapsed = time.monotonic() - started

    if offenders:
        lines = [f"x{n} {example}" for (_tpl, _st, _op), (n, example) in sorted(
            offenders.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]), kv[0][2]))]
        total = sum(n for n, _ in offenders.values())
        checks.add(f"{total} of {sent} mutations got a 5xx or no answer ({len(lines)} kinds):\n"
                   + "\n".join("      " + line for line in lines))
    trips = box.take_trips()
    checks.add(*trips)
    if box.generation != generation:
        checks.add("the daemon died during the fuzz (so no RSS or restart comparison)")
        box.ensure_up()
        sc = tinker.ServiceClient(base_url=box.url, api_key=box.keys["good"])
        tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=T)
    checks.check("a good tenant's round after the fuzz", _good_round, tc, data)
    _settle(box)
    if box.generation == generation:
        restarts1, rss1 = box.restarts(), rss_mb(box.pid)
        if restarts1 != restarts0:
            checks.add(f"twinkle_worker_restarts_total moved: {restarts0} -> {restarts1}")
        if rss1 - rss0 >= MAX_RSS_GROWTH_MB:
            checks.add(f"the daemon's RSS grew {rss1 - rss0:.0f} MB ({rss0:.0f} -> {rss1:.0f} "
                       f"MB; limit {MAX_RSS_GROWTH_MB})")
    if sent < N_MUTATIONS:  # a slow machine: say so, but time is not what this test checks
        warnings.warn(f"only {sent} of {N_MUTATIONS} mutations were sent in {elapsed:.0f} s",
                      stacklevel=1)
    checks.done()


# -- issue 28: the OpenAI face and the admin API ------------------------------------------------

N_FACE_MUTATIONS = 400
FACE_CAP_S = 12


def test_fuzz_openai_face_and_admin_api(box, tiny_dir):
    """The same properties for the other two faces: no 5xx, no request unanswered, no
    worker restart, the daemon's RSS bounded."""
    from fuzz_faces import SLOW, SLOW_S, Faces

    box.ensure_up()
    rng, checks = random.Random(1), Checks()
    faces = Faces(box.url, box.keys["fuzz"], box.data_dir, tiny_dir.name, REQUEST_TIMEOUT)
    # Warm every path first. The first completion starts the sampler, which on a loaded CI
    # machine took more than SLOW_S: a valid request gets as long as any request may take.
    for face, path, body in faces.text_requests() + faces.admin_requests():
        a = faces.send(face, path, dumps(body).encode(), {"Content-Type": "application/json"},
                       slow_s=T)
        assert a.status is not None and a.status < 500, f"valid {face} {path}: {a.describe()}"
    generation, rss0, restarts0 = box.generation, rss_mb(box.pid), box.restarts()
    offenders: dict[tuple, list] = {}
    sent, slow, started = 0, 0, time.monotonic()
    while sent < N_FACE_MUTATIONS and time.monotonic() - started < FACE_CAP_S:
        face, path, body = faces.valid(rng)
        headers = {"Content-Type": "application/json"}
        if rng.random() < 0.8:
            mutated, done = mutate_json(body, rng)
            data = dumps(mutated).encode("utf-8", "surrogatepass")
        else:
            data, headers, what = mutate_bytes(dumps(body).encode(), headers, rng)
            done = [what]
        a = faces.send(face, path, data, headers)
        sent += 1
        if a.error == SLOW and box.d.health() is not None:  # a long valid completion
            slow += 1
            continue
        if a.status is None or a.status >= 500:
            entry = offenders.setdefault((face, path, a.status), [0, ""])
            entry[0] += 1
            entry[1] = entry[1] or f"{'; '.join(done)[:200]} -> {a.describe(200)}"
            if a.status is None and _revive(box):
                checks.add(f"the daemon was dead or stuck after {face} {path}: restarted")
                break
    faces.close()
    checks.add(*[f"x{n} {face} {path} {status or 'no answer'}: {example}"
                 for (face, path, status), (n, example) in offenders.items()])
    checks.add(*box.take_trips())
    _settle(box, cap=20)
    if box.generation == generation:
        if box.restarts() != restarts0:
            checks.add(f"twinkle_worker_restarts_total moved: {restarts0} -> {box.restarts()}")
        if rss_mb(box.pid) - rss0 >= MAX_RSS_GROWTH_MB:
            checks.add(f"the daemon's RSS grew {rss_mb(box.pid) - rss0:.0f} MB")
    else:
        checks.add("the daemon died during the fuzz")
    if sent < N_FACE_MUTATIONS or slow:
        warnings.warn(f"{sent} of {N_FACE_MUTATIONS} face mutations were sent; {slow} "
                      f"completions still ran after {SLOW_S} s (cut)", stacklevel=1)
    checks.done()


def test_admin_arguments_are_typed_at_the_door(box, tiny_dir):
    """Issue 28 item 9: wrong types and unknown arguments were 500s, and a `max_rank` of
    "x" was stored and broke every create_model of the tenant."""
    import httpx

    box.ensure_up()
    key = (box.data_dir / "admin.key").read_text().strip()
    with httpx.Client(base_url=f"{box.url}/admin/v1", headers={"X-Admin-Key": key},
                      timeout=REQUEST_TIMEOUT) as admin:
        for command, body, named in [
                ("tenants_set", {"name": "good", "weight": "x"}, "weight"),
                ("tenants_set", {"name": "good", "max_rank": "x"}, "max_rank"),
                ("tenants_set", {"name": "good", "max_rank": 2**70}, "max_rank"),
                ("tenants_set", {"name": "good", "weight": -1}, "weight"),
                ("keys_create", {"tenant": 123}, "tenant"),
                ("drain", {"bogus": 1}, "bogus"),
                ("drain", {"timeout": "soon"}, "timeout"),
                ("runs_list", {"limit": "all"}, "limit")]:
            r = admin.post(f"/{command}", json=body)
            assert r.status_code == 400 and named in r.json()["detail"], (command, body, r.text)
        r = admin.post("/drain", content=b"\xff\xfe")
        assert r.status_code == 400 and "JSON object" in r.json()["detail"]
        assert admin.post("/drain", json={"undo": True}).status_code == 200
    # Nothing was stored: the tenant still creates models.
    sc = tinker.ServiceClient(base_url=box.url, api_key=box.keys["good"])
    sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=T)


def _vm_bytes(pid: int) -> int:
    from pathlib import Path

    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmSize for {pid}")


def test_a_30_mib_prompt_under_a_memory_cap_is_a_400_and_others_are_served(box, tiny_dir):
    """Issue 28 item 1: a 30 MiB prompt was tokenized before any length check (gigabytes
    in the tokenizer) and aborted the daemon. Under an address-space cap like a
    container's (its size now + 1.5 GiB), the prompt and a chat of the same size are
    400s naming the parameter, the daemon lives, and another tenant's completions are
    served during and after. Token ids of the same size are refused too."""
    import resource
    import threading

    import httpx

    box.ensure_up()
    pid, generation = box.pid, box.generation
    old = resource.prlimit(pid, resource.RLIMIT_AS)
    resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + (3 << 29), old[1]))
    huge = "the sun and the sea " * (30 * 2**20 // 20)
    served, stop = [], threading.Event()

    def other_tenant():  # completions of the good tenant, all along
        with httpx.Client(base_url=f"{box.url}/oai/api/v1", timeout=T,
                          headers={"Authorization": f"Bearer {box.keys['good']}"}) as c:
            while not stop.is_set() or len(served) < 2:
                r = c.post("/completions", json={"model": tiny_dir.name, "prompt": "the sun",
                                                 "max_tokens": 2})
                served.append(r.status_code)

    thread = threading.Thread(target=other_tenant)
    try:
        thread.start()
        with httpx.Client(base_url=f"{box.url}/oai/api/v1", timeout=120,
                          headers={"Authorization": f"Bearer {box.keys['fuzz']}"}) as c:
            for path, body, param in [
                    ("/completions", {"model": tiny_dir.name, "prompt": huge}, "prompt"),
                    ("/chat/completions", {"model": tiny_dir.name, "messages": [
                        {"role": "user", "content": huge}]}, "messages"),
                    ("/completions", {"model": tiny_dir.name,  # 30 MiB of token ids
                                      "prompt": [1000] * (6 * 2**20)}, "prompt")]:
                try:
                    r = c.post(path, json=body)
                except httpx.HTTPError as e:
                    raise AssertionError(f"{path}: no answer ({e}); the daemon "
                                         f"{'lives' if box.alive() else 'died'}") from None
                assert r.status_code == 400, (path, r.status_code, r.text[:300])
                assert r.json()["error"]["param"] == param, r.text[:300]
        stop.set()
        thread.join(timeout=2 * T)
        assert box.alive() and box.generation == generation
        assert served and set(served) == {200}, served
    finally:
        stop.set()
        thread.join(timeout=2 * T)
        if box.alive():
            resource.prlimit(pid, resource.RLIMIT_AS, old)
