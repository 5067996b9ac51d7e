"""The live state of a training adapter, as persisted between checkpoints (`workers/persist`).

Not a user-facing checkpoint (those are PEFT directories, `state.py`): a snapshot's flat
buffer is written as is, `state.bin`, with a JSON index, `state.json`. The writer runs in a
background thread beside a host-bound training loop, so the format is chosen to cost no
copy under the GIL: one `write` of the pinned buffer (the GIL is released for the system
call), where serialising through safetensors would first copy every tensor to `bytes`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from twinkled.protocol.types import EngineInputError, LoraConfig

from .moe_peft import from_peft, is_expert, key_of_module
from .state import PEFT_PREFIX, WEIGHTS, Snapshot

INDEX = "state.json"
DATA = "state.bin"


def is_live(path: str | Path) -> bool:
    return (Path(path) / INDEX).is_file()


def write_live(snap: Snapshot, path: str | Path, mark: int = 0) -> int:
    """Write `snap` to directory `path` atomically (temp dir, fsync, rename); returns bytes.

    `mark`: the journal position of the last operation the snapshot holds (the daemon
    replays its journal from there, `twinkled/core/journal.py`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        flat = snap.host()
        with open(tmp / DATA, "wb") as f:
            f.write(memoryview(flat.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        index = {"config": asdict(snap.config), "steps": snap.steps, "mark": mark,
                 "dtype": "float32",
                 "tensors": [[file, name, list(shape)] for file, name, shape in snap.names]}
        with open(tmp / INDEX, "w") as f:
            f.write(json.dumps(index))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        # The daemon drops its journal's records up to `mark` once told this is written:
        # the rename itself must survive a power loss first.
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return (path / DATA).stat().st_size


def read_mark(path: str | Path) -> int:
    """The journal position a persisted state was written at (0 if none is recorded)."""
    try:
        return int(json.loads((Path(path) / INDEX).read_text()).get("mark", 0))
    except (OSError, ValueError, TypeError) as e:
        raise EngineInputError("path", f"{path}: unreadable live state: {e}") from None


def read_live(path: str | Path) -> tuple[LoraConfig, dict, dict, int]:
    """(config, weights by module key as (A, B), moments by name, steps), as read_adapter."""
    path = Path(path)
    try:
        index = json.loads((path / INDEX).read_text())
        names = [(file, name, tuple(s)) for file, name, s in index["tensors"]]
        total = sum(math.prod(s) for _, _, s in names)
        flat = torch.from_file(str(path / DATA), size=total, dtype=torch.float32)
        config = LoraConfig(**index["config"])
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise EngineInputError("path", f"{path}: unreadable live state: {e}") from None
    weights, moments = unflatten(names, flat, config)
    return config, weights, moments, int(index["steps"])


def unflatten(names: list[tuple[str, str, tuple[int, ...]]], flat: torch.Tensor,
              config: LoraConfig) -> tuple[dict, dict]:
    """A snapshot's flat buffer (`Snapshot.names` says what lies where) as (weights by
    module key as (A, B), moments by name): views of `flat`, what `state.write_into` takes.
    The disk tier reads it from `state.bin`, the host tier (workers/parked.py) from memory."""
    weights: dict[str, list] = {}
    moments: dict[str, torch.Tensor] = {}
    for (file, name, shape), part in zip(names, flat.split([math.prod(s) for _, _, s in names]),
                                         strict=True):
        t = part.view(shape)
        if file == WEIGHTS:  # base_model.model.<module>.lora_A.weight
            module, which = name[len(PEFT_PREFIX):].rsplit(".", 2)[:2]
            weights.setdefault(key_of_module(module), [None, None])[which == "lora_B"] = t
        else:
            moments[name] = t
    for key, (a, b) in weights.items():  # expert pairs are kept in peft's layout
        if is_expert(key):
            shape = (a.shape[1], b.shape[0], a.shape[0] // config.rank)
            weights[key] = from_peft(key, a, b, config.rank, shape)
    return {k: tuple(ab) for k, ab in weights.items()}, moments
