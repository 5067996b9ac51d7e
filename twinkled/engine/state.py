"""Adapter files: PEFT format for weights, safetensors for the optimizer state.

A checkpoint is a directory:
  adapter_config.json, adapter_model.safetensors   PEFT LoRA (peft, vLLM and others load it)
  optimizer.safetensors                            AdamW moments (exp_avg, exp_avg_sq) or
                                                   Dimuon momentum (momentum_buffer), the
                                                   step count and the family (metadata)
Files are written into a temporary sibling directory and fsynced; that directory then
takes the final name in one atomic exchange (`_put_in_place`), so a crash at any point leaves
the old checkpoint or the new one under that name, never none and never half of one.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from twinkled.protocol.checkpoints import fsync_path
from twinkled.protocol.types import (
    ATTN_MODULES,
    EXPERT_MODULES,
    LINEAR_ATTN_MODULES,
    MLA_MODULES,
    MLP_MODULES,
    UNEMBED_MODULES,
    EngineInputError,
    LoraConfig,
)

from .lora import Adapter
from .moe_peft import from_peft, is_expert, key_of_module, peft_module, peft_parameters, to_peft

PEFT_PREFIX = "base_model.model."
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
OPTIMIZER = "optimizer.safetensors"
# An optimizer family's state: (bank buffer, tensor name suffix). Dimuon keeps only its
# momentum, under torch.optim.Muon's name for it.
MOMENTS = {"adamw": (("m", "exp_avg"), ("v", "exp_avg_sq")),
           "dimuon": (("m", "momentum_buffer"),)}


@dataclass
class Snapshot:
    """An adapter's tensors, copied at one instant: later steps cannot change it.

    The copy is one flat buffer. On a GPU a small adapter's is made on the device (one
    kernel) and then brought to pinned host memory on a side stream, so the next step does
    not wait for it; a big one's goes to the host at once (`snapshot`). `files()` waits
    for that copy and gives each file's tensors."""

    config: LoraConfig
    steps: int
    names: list[tuple[str, str, tuple[int, ...]]]  # (file, tensor name, shape), flat order
    flat: torch.Tensor
    ready: torch.cuda.Event | None = None
    _device_copy: torch.Tensor | None = None  # kept alive until the host copy is done

    def host(self) -> torch.Tensor:
        """The flat host copy, once the device-to-host copy has finished."""
        if self.ready is not None:
            self.ready.synchronize()
            self._device_copy = None
        return self.flat

    def copied(self) -> bool:
        """Whether the copy to the host has finished, never waiting; once it has, the
        device copy is let go."""
        if self.ready is not None and not self.ready.query():
            return False
        self._device_copy = None
        return True

    def files(self) -> dict[str, dict[str, torch.Tensor]]:
        self.host()
        out: dict[str, dict[str, torch.Tensor]] = {}
        parts = self.flat.split([math.prod(shape) for _, _, shape in self.names])
        for (file, name, shape), part in zip(self.names, parts, strict=True):
            # safetensors refuses tensors that share memory: one owned copy each.
            out.setdefault(file, {})[name] = part.view(shape).clone()
        return out


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}

SMALL_SNAPSHOT = 64 * 2**20  # elements (256 MiB of fp32)


def snapshot(adapter: Adapter, optimizer: bool, shard=None,
             into: torch.Tensor | None = None) -> Snapshot:
    """`shard` (tp.py): the bank holds tensor-parallel slices; the snapshot is of the
    whole tensors, gathered over the group (a collective: every rank calls it). `into`: host
    bytes to copy it into, at least its size (a piece of the host tier's arena,
    workers/parked.py); else a buffer of its own (pinned on a GPU)."""
    bank, slot = adapter.bank, adapter.slot
    keys = list(bank.shapes)
    # The bank's cached views of the slot ("w": every A then every B; "m", "v" likewise),
    # so a snapshot is one cat kernel however many modules the adapter has.
    parts = [(k, p) for p in ("lora_A", "lora_B") for k in keys]
    # Expert pairs are written in peft's layout (moe_peft.py): a copy, the rest are views.
    views = [to_peft(k, p, v) for (k, p), v in zip(parts, bank.tensors(slot, "w"), strict=True)]
    names = [(WEIGHTS, f"{PEFT_PREFIX}{peft_module(k)}.{p}.weight") for k, p in parts]
    if optimizer:
        for kind, suffix in MOMENTS[adapter.config.optimizer]:
            views += bank.tensors(slot, kind)
            names += [(OPTIMIZER, f"{k}.{p}.{suffix}") for p in ("lora_A", "lora_B") for k in keys]
    if shard is not None:
        views = shard.gather_views(keys, views)
    names = [(f, n, tuple(v.shape)) for (f, n), v in zip(names, views, strict=True)]
    total = sum(v.numel() for v in views)
    if into is not None and into.nbytes >= total * views[0].element_size():
        into = into.view(views[0].dtype)[:total]
    else:
        into = None
    if not views[0].is_cuda:
        return Snapshot(adapter.config, adapter.steps, names,
                        torch.cat([v.reshape(-1) for v in views], out=into))
    device = views[0].device
    host = into if into is not None else torch.empty(total, dtype=views[0].dtype,
                                                     pin_memory=True)
    flat = None
    if total < SMALL_SNAPSHOT and has_room(device, total * views[0].element_size()):
        try:
            flat = torch.cat([v.reshape(-1) for v in views])
        except torch.OutOfMemoryError:  # a card near full (a bank at its budget): as a big one
            flat = None
    if flat is None:
        # A big adapter (a 32B model's, with its moments, is GiBs) is copied view by view
        # and waited for: a cat would need as much free GPU memory again beside a model
        # that fills the card, and so would keeping its gathered tensor-parallel slices
        # until a writer thread gets to it (8 tenants created in one step held 8 of them:
        # measured out of memory on 2 x H100 with a 32B model).
        at = 0
        for v in views:
            host[at:at + v.numel()].copy_(v.reshape(-1), non_blocking=True)
            at += v.numel()
        torch.cuda.current_stream(device).synchronize()
        return Snapshot(adapter.config, adapter.steps, names, host)
    stream = _copy_streams.setdefault(device, torch.cuda.Stream(device))
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        host.copy_(flat, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
    return Snapshot(adapter.config, adapter.steps, names, host, ready, flat)


def has_room(device: torch.device, nbytes: int) -> bool:
    """Whether a buffer of `nbytes` can be had on `device` without the caching allocator
    running out: then it frees its whole cache and tries again, which synchronises the
    device and costs the next steps their cached blocks (measured: each park of a
    1,000-run bench at a full bank did so, ~3 parks a second). Free on the card, or
    several times `nbytes` free in the allocator's cache (likely one block of it)."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free >= nbytes + 2**30 or cached >= 4 * nbytes


def to_device(flat: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A parked snapshot's flat host buffer on `device`, for `write_into` to read: on a GPU
    one copy on the side stream (from pinned memory it does not wait for the kernels of the
    step in flight, which it overlaps), which the compute stream waits for before reading
    it. A big one (SMALL_SNAPSHOT) stays on the host: a device copy of it would need as
    much free GPU memory again; `write_into` then copies it view by view."""
    device = torch.device(device)
    if (device.type != "cuda" or flat.numel() >= SMALL_SNAPSHOT
            or not has_room(device, flat.nbytes)):
        return flat
    stream = _copy_streams.setdefault(device, torch.cuda.Stream(device))
    compute = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        try:
            out = torch.empty(flat.shape, dtype=flat.dtype, device=device)
        except torch.OutOfMemoryError:  # a card near full: from the host, as a big one
            return flat
        out.copy_(flat, non_blocking=flat.is_pinned())
    compute.wait_stream(stream)
    out.record_stream(compute)  # allocated on the side stream, read on the compute one
    return out


def write_snapshot(snap: Snapshot, path: str | Path, base_model: str) -> int:
    """Write a snapshot as a checkpoint directory, atomically; returns bytes written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        cfg = snap.config
        files = snap.files()
        save_file(files[WEIGHTS], tmp / WEIGHTS, metadata={"format": "pt"})
        peft_config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank,
            "lora_alpha": cfg.alpha, **_peft_targets(snap),
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True, "base_model_name_or_path": base_model,
        }
        (tmp / CONFIG).write_text(json.dumps(peft_config, indent=2))
        if OPTIMIZER in files:
            meta = {"steps": str(snap.steps), "seed": str(cfg.seed),
                    "optimizer": cfg.optimizer}
            save_file(files[OPTIMIZER], tmp / OPTIMIZER, metadata=meta)
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        _put_in_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sum(f.stat().st_size for f in path.iterdir())


_RENAME_EXCHANGE = 2  # linux/fs.h
_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); OSError where the
    system or file system cannot."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def _aside(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


def recover(path: str | Path) -> None:
    """Where a crash of the fallback below left the old checkpoint aside and none under its
    name, put the old one back (a save that had not finished never happened)."""
    path = Path(path)
    if not path.exists() and _aside(path).is_dir():
        os.replace(_aside(path), path)
        fsync_path(path.parent)


def _put_in_place(tmp: Path, path: Path) -> None:
    """Give the finished directory `tmp` the name `path`, replacing any checkpoint there.

    A directory cannot be renamed over a non-empty one, and deleting the old one first
    would leave no checkpoint if the process died in between. So the two are exchanged
    atomically, and the old one (now under the temporary name) deleted after. Where the
    exchange is not supported, the old one is renamed aside first, the new one renamed in,
    then the old deleted; `recover` (run by every read and write) puts it back if a crash
    fell between the two renames."""
    recover(path)
    if not path.exists():
        os.replace(tmp, path)
    else:
        try:
            _exchange(tmp, path)
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EXDEV):
                raise
            shutil.rmtree(_aside(path), ignore_errors=True)
            os.replace(path, _aside(path))
            fsync_path(path.parent)
            os.replace(tmp, path)
            tmp = _aside(path)
        fsync_path(path.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # the old checkpoint, out of the way
    fsync_path(path.parent)


def _peft_targets(snap: Snapshot) -> dict:
    """target_modules (and for an MoE model, target_parameters) of the snapshot's adapter."""
    keys = [key_of_module(name[len(PEFT_PREFIX):].rsplit(".", 2)[0])
            for file, name, _ in snap.names if file == WEIGHTS]
    experts = peft_parameters(keys)
    if not experts:
        return {"target_modules": sorted(snap.config.target_modules)}
    # Only modules the model has: peft refuses names that match nothing when all do.
    modules = sorted({k.rsplit(".", 1)[-1] for k in keys if not is_expert(k)})
    return {"target_modules": modules, "target_parameters": experts}



def read_adapter(path: str | Path, targets: dict[str, tuple[int, int]], max_rank: int,
                 optimizer: bool) -> tuple[LoraConfig, dict, dict | None, int]:
    """Read and check a checkpoint fully before anything is changed.

    Returns (config, weights by key, moments by key or None, steps).
    """
    path = Path(path)
    recover(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise EngineInputError("path", f"{path} holds no PEFT adapter ({CONFIG} + {WEIGHTS})")
    pc = json.loads((path / CONFIG).read_text())
    for flag in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if pc.get(flag):
            raise EngineInputError("adapter_config", f"{flag} adapters are not supported")
    if pc.get("rank_pattern") or pc.get("alpha_pattern"):
        raise EngineInputError("adapter_config", "rank_pattern/alpha_pattern are not supported")
    rank = int(pc["r"])
    if not 1 <= rank <= max_rank:
        raise EngineInputError("rank", f"adapter rank {rank} is outside 1..{max_rank}")
    names = pc.get("target_modules") or []
    names = [names] if isinstance(names, str) else names
    attn = ATTN_MODULES + LINEAR_ATTN_MODULES + MLA_MODULES
    known = attn + MLP_MODULES + UNEMBED_MODULES
    unknown = [n for n in names if n.rsplit(".", 1)[-1] not in known]
    if unknown:
        raise EngineInputError("target_modules", f"cannot adapt {unknown}; supported: {known}")
    short = {n.rsplit(".", 1)[-1] for n in names}
    params = {n.rsplit(".", 1)[-1] for n in pc.get("target_parameters") or []}
    if params - set(EXPERT_MODULES):
        raise EngineInputError("target_parameters", f"cannot adapt {sorted(params)}; "
                               f"supported: {EXPERT_MODULES}")
    config = LoraConfig(
        rank=rank, alpha=float(pc.get("lora_alpha", rank)),
        train_attn=bool(short & set(attn)),
        train_mlp=bool(short & set(MLP_MODULES) or params),
        train_unembed=bool(short & set(UNEMBED_MODULES)))
    tensors = load_file(path / WEIGHTS)
    weights = {}
    for key, shape in targets.items():
        a = tensors.pop(f"{PEFT_PREFIX}{peft_module(key)}.lora_A.weight", None)
        b = tensors.pop(f"{PEFT_PREFIX}{peft_module(key)}.lora_B.weight", None)
        if a is None and b is None:
            continue  # a module this adapter leaves alone (e.g. q/v only): stays zero
        if a is None or b is None:
            raise EngineInputError("weights", f"{key}: lora_A and lora_B must come together")
        a, b = from_peft(key, a.float(), b.float(), rank, shape)
        weights[key] = (a, b)
    if tensors:
        extra = sorted(tensors)[:3]
        raise EngineInputError("weights", f"tensors that match no module of this model: {extra}")
    moments, steps = None, 0
    if optimizer:
        if not (path / OPTIMIZER).is_file():
            raise EngineInputError("path", f"{path} has no optimizer state ({OPTIMIZER})")
        from safetensors import safe_open

        with safe_open(path / OPTIMIZER, "pt") as f:
            meta = f.metadata() or {}
        steps = int(meta.get("steps", 0))
        family = meta.get("optimizer", "adamw")  # files from before Dimuon are AdamW's
        if family not in MOMENTS:
            raise EngineInputError("path", f"{path}: unknown optimizer {family!r} in {OPTIMIZER}")
        config = replace(config, optimizer=family)
        moments = load_file(path / OPTIMIZER)
    return config, weights, moments, steps


@torch.no_grad()
def write_into(adapter: Adapter, weights: dict, moments: dict | None, steps: int,
               shard=None) -> None:
    """Copy checked tensors into the adapter's bank slot; gradients are cleared.
    `shard` (tp.py): the bank holds tensor-parallel slices; each takes its own."""
    bank, slot = adapter.bank, adapter.slot
    bank.zero_slot(slot, weights=True)

    def mine(key: str, part: str, t: torch.Tensor) -> torch.Tensor:
        return t if shard is None else shard.local_lora(key, part, t)

    for key, (a, b) in weights.items():
        bank.A[key][slot].copy_(mine(key, "A", a))
        bank.B[key][slot].copy_(mine(key, "B", b))
    if moments is not None:
        buffers = {"m": (bank.mA, bank.mB), "v": (bank.vA, bank.vB)}
        for kind, suffix in MOMENTS[adapter.config.optimizer]:
            for key in bank.shapes:
                for part, store in zip(("lora_A", "lora_B"), buffers[kind], strict=True):
                    if f"{key}.{part}.{suffix}" in moments:
                        store[key][slot].copy_(mine(key, part[-1],
                                                    moments[f"{key}.{part}.{suffix}"]))
    bank.changed(slot)
    adapter.steps = steps
    adapter.pending = 0
    adapter.counters = []
