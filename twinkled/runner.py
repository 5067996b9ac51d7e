"""Runs one step of queued operations on the engine (in the engine thread).

Each op is checked on its own first, so a bad request fails alone (category "user") while
the rest of the step runs. Returns, per op, (result, error message or None, category).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path

from .engine import Engine, EngineInputError

Outcome = tuple[object, str | None, str | None]


def run_ops(engine: Engine, kind: str, ops: list) -> list[Outcome]:
    """Run one planned step: "sample", "barrier" ops, or "train": co-batched rows, then the
    barriers (optim steps ...) that the planner put behind them."""
    if kind == "sample":
        return _sample(engine, ops)
    rows = [op for op in ops if op.kind == "fwdbwd"]
    barriers = [op for op in ops if op.kind != "fwdbwd"]
    outcomes = {}
    if rows:
        outcomes.update(zip(map(id, rows), _forward_backward(engine, rows), strict=True))
    if barriers:
        outcomes.update(zip(map(id, barriers), _barriers(engine, barriers), strict=True))
    return [outcomes[id(op)] for op in ops]


def _barriers(engine: Engine, ops: list) -> list[Outcome]:
    outcomes = {id(op): _one(engine, op) for op in ops if op.kind != "optim"}
    optims = [op for op in ops if op.kind == "optim"]
    if optims:  # several models' optimizer steps as one engine call
        try:
            results = engine.optim_steps([(op.args["adapter_id"], op.args["params"])
                                          for op in optims])
            outcomes.update({id(op): (r, None, None) for op, r in zip(optims, results, strict=True)})
        except EngineInputError:  # one bad step: run them one by one to blame the right one
            outcomes.update({id(op): _one(engine, op) for op in optims})
    return [outcomes[id(op)] for op in ops]


def _each_checked(ops: list, check, run) -> list[Outcome]:
    """Check each op alone (a bad one fails alone, category "user"); run the rest together."""
    outcomes: list[Outcome | None] = [None] * len(ops)
    good = []
    for i, op in enumerate(ops):
        try:
            check(op)
            good.append(i)
        except EngineInputError as e:
            outcomes[i] = (None, str(e), "user")
    if good:
        results = run([ops[i].args["request"] for i in good])
        for i, r in zip(good, results, strict=True):
            outcomes[i] = (r, None, None)
    return outcomes


def _forward_backward(engine: Engine, ops: list) -> list[Outcome]:
    return _each_checked(ops, lambda op: engine.check(op.args.get("check", op.args["request"])),
                         engine.forward_backward)


SAMPLER_ADAPTERS = 32  # sampler checkpoints kept loaded; the least recently used goes first


def _sample(engine: Engine, ops: list) -> list[Outcome]:
    loaded = engine.__dict__.setdefault("sampler_lru", OrderedDict())

    def check(op):
        adapter = op.args.get("adapter_id")
        if op.args.get("load_from"):
            if not engine.has_adapter(adapter):
                engine.load(adapter, op.args["load_from"], optimizer=False)
            loaded[adapter] = True
            loaded.move_to_end(adapter)
        engine.check(op.args["request"])

    outcomes = _each_checked(ops, check, engine.sample)
    in_use = {op.args.get("adapter_id") for op in ops}
    while len(loaded) > SAMPLER_ADAPTERS:
        old = next(iter(loaded))
        if old in in_use:
            break
        loaded.pop(old)
        engine.remove_adapter(old)
    return outcomes


def _one(engine: Engine, op) -> Outcome:
    a = op.args
    try:
        if op.kind == "create":
            engine.add_adapter(a["adapter_id"], a["config"])
            return engine.adapter_info(a["adapter_id"]), None, None
        if op.kind == "optim":
            return engine.optim_step(a["adapter_id"], a["params"]), None, None
        if op.kind == "save":
            engine.save(a["adapter_id"], a["dir"], optimizer=a["optimizer"])
            return checkpoint_digest(Path(a["dir"])), None, None
        if op.kind == "load":
            return engine.load(a["adapter_id"], a["dir"], optimizer=a["optimizer"]), None, None
        if op.kind == "unload":
            if engine.has_adapter(a["adapter_id"]):
                engine.remove_adapter(a["adapter_id"])
            return None, None, None
        return None, f"unknown operation {op.kind!r}", "server"
    except EngineInputError as e:
        return None, str(e), "user"


def checkpoint_digest(path: Path) -> tuple[int, str]:
    """(total bytes, sha256 over the directory's files in name order)."""
    h = hashlib.sha256()
    size = 0
    for f in sorted(path.iterdir()):
        data = f.read_bytes()
        h.update(f.name.encode() + b"\0" + data)
        size += len(data)
    return size, h.hexdigest()
