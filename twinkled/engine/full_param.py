"""A full-parameter run (LoRA rank 0): the lane's base model itself trains.

A full run holds its lane alone (the daemon reserves it: core/lanes.py), so the weights
the lane's passes read ARE the run's weights: no second copy in the compute dtype. The run
keeps fp32 master weights and two fp32 AdamW moments beside them (aliasing the weights when
the model is fp32 already) and copies the masters back into the compute weights, in place,
after each step (in place: the q/k/v and gate/up modules' weights are views of one joint
tensor, fused_ops.concat_linears, which sampling reads). Gradients land in the modules'
`.grad` through the ordinary forward (step.forward_backward with `base_trains`); the
model's joint GEMMs and the chunked head, which keep no weight gradients, are turned off
while the run lives. When it ends, the base weights are read back from the model's files.

A checkpoint of a full run is a Hugging Face model directory (config.json, tokenizer
files, model.safetensors of the fp32 masters), which `from_pretrained` loads as it is,
plus optimizer.safetensors (moments) and full_run.json (steps): saving is exporting.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.optim.adamw import adamw

from twinkled.protocol.checkpoints import fsync_path
from twinkled.protocol.types import (
    AdamParams,
    AdapterInfo,
    DimuonParams,
    EngineInputError,
    LoraConfig,
    OptimResult,
)

from .model import BaseModel

MARKER = "full_run.json"  # what tells a full run's checkpoint from an adapter's
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
# Files of the base model's directory a checkpoint carries along, so that it loads alone.
_CARRIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
            "added_tokens.json", "chat_template.jinja")


def is_full_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


class FullRun:
    """The trainable state of one full-parameter run over `model`. On a data-parallel lane
    (`dp_group`) every rank holds the compute weights and gradients whole, while the fp32
    masters and AdamW moments (12 of the 16 bytes a parameter) are split over the ranks
    by parameter (ZeRO stage 1): each parameter's gradient is summed onto its owner, which
    steps it and broadcasts the new weights."""

    def __init__(self, run_id: str, model: BaseModel, config: LoraConfig, dp_group=None):
        if model.shard is not None or model.moe:
            raise EngineInputError("lora_config.rank", "full-parameter runs (rank 0) are not "
                                   "supported on tensor-parallel or MoE worker groups yet")
        if config.optimizer != "adamw":
            raise EngineInputError("optimizer_config.type", "a full-parameter run (rank 0) "
                                   "trains with AdamW only")
        self.id, self.model, self.config, self.group = run_id, model, config, dp_group
        self.steps = self.pending = 0
        # Unique parameters by name (a tied lm_head shares the embedding: named once).
        self.names, self.params = zip(*model.hf.named_parameters(), strict=True)
        world = 1 if dp_group is None else dist.get_world_size(dp_group)
        self.rank = 0 if dp_group is None else dist.get_rank(dp_group)
        self.owner = owners([p.numel() for p in self.params], world)
        fp32 = model.dtype == torch.float32
        self.master = [None if o != self.rank else p.data if fp32 else p.detach().float().clone()
                       for p, o in zip(self.params, self.owner, strict=True)]
        self.m = [None if w is None else torch.zeros_like(w) for w in self.master]
        self.v = [None if w is None else torch.zeros_like(w) for w in self.master]
        self.counters = [torch.zeros((), dtype=torch.float32) for _ in self.master]
        self._levers = (model.fused, model.head)
        model.fused = replace(model.fused, gemm=False)  # the joint GEMM keeps no .grad
        model.head = "full"  # the chunked head keeps no lm_head gradient
        model.hf.requires_grad_(True)

    def info(self) -> AdapterInfo:
        return AdapterInfo(self.id, 0, 0.0, (), self.steps, self.pending, "adamw")

    def _src(self, k: int) -> int:
        """Parameter k's owner as a global rank (what collectives name)."""
        return dist.get_global_rank(self.group, self.owner[k])

    # -- training -----------------------------------------------------------------------

    def trained(self, rows: int) -> None:
        self.pending += rows

    @torch.no_grad()
    def step(self, params: AdamParams | DimuonParams) -> OptimResult:
        """AdamW (decoupled weight decay, as torch.optim.AdamW) on the fp32 masters from the
        gradients accumulated since the last step; the compute weights follow. One tensor
        at a time: a gradient's fp32 copy lives only while its own update runs."""
        if not isinstance(params, AdamParams):
            raise EngineInputError("adam_params", "a full-parameter run steps with AdamW")
        for p in self.params:
            if p.grad is None:  # (untouched by the rows: zero, so every rank has one)
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        mine = [k for k, o in enumerate(self.owner) if o == self.rank]
        squares = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        if self.group is not None:  # rows were split over the ranks: sum onto the owners
            pending = torch.tensor([float(self.pending)], device=grads[0].device)
            dist.all_reduce(pending, group=self.group)
            self.pending = round(float(pending))
            for k, g in enumerate(grads):
                dist.reduce(g, dst=self._src(k), group=self.group)
        for k in mine:
            squares += torch.linalg.vector_norm(grads[k], dtype=torch.float32) ** 2
        if self.group is not None:
            dist.all_reduce(squares, group=self.group)
        norm = float(squares.sqrt())
        if self.pending == 0 or not math.isfinite(norm):
            self.zero_grad()
            why = "no pending gradients" if self.pending == 0 else \
                "non-finite gradient norm; gradients dropped"
            return OptimResult(False, {"grad_norm:mean": norm, "skipped:sum": 1.0,
                                       "reason": why})
        scale = 1.0
        if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
            scale = params.grad_clip_norm / (norm + 1e-6)
        for k in mine:
            p, g = self.params[k], grads[k].float()
            if scale != 1.0:
                g = g * scale
            adamw([self.master[k]], [g], [self.m[k]], [self.v[k]], [], [self.counters[k]],
                  foreach=False, amsgrad=False, beta1=params.beta1, beta2=params.beta2,
                  lr=params.learning_rate, weight_decay=params.weight_decay, eps=params.eps,
                  maximize=False)
            p.grad = None
            if self.master[k] is not p.data:
                p.data.copy_(self.master[k])  # in place: views stay views
        self.zero_grad()
        if self.group is not None:  # every rank's weights from their owners
            for k, p in enumerate(self.params):
                dist.broadcast(p.data, src=self._src(k), group=self.group)
        self.steps += 1
        return OptimResult(True, {"grad_norm:mean": norm, "learning_rate:mean":
                                  params.learning_rate, "step:max": float(self.steps)})

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.pending = 0

    # -- state --------------------------------------------------------------------------

    def _gathered(self, tensors: list, k: int, write: bool):
        """Parameter k's fp32 state from its owner (a collective on a data-parallel
        lane), on the host where `write`."""
        t = tensors[k]
        if self.group is not None:
            if t is None:
                p = self.params[k]
                t = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            dist.broadcast(t, src=self._src(k), group=self.group)
        return t.detach().contiguous().cpu() if write else None

    def save(self, path: str | Path, optimizer: bool = True, write: bool = True) -> int:
        """A Hugging Face model directory of the masters (+ moments), atomically; bytes.
        On a data-parallel lane every rank calls it (the state is gathered from its
        owners); those with `write` write the files."""
        ks = range(len(self.params))
        weights = {self.names[k]: self._gathered(self.master, k, write) for k in ks}
        moments = {f"{kind}.{self.names[k]}": self._gathered(ts, k, write)
                   for kind, ts in (("m", self.m), ("v", self.v)) for k in ks} \
            if optimizer else None
        if not write:
            return 0
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            for name in _CARRIED:
                if (self.model.dir / name).is_file():
                    shutil.copy(self.model.dir / name, tmp / name)
            save_file(weights, tmp / WEIGHTS, metadata={"format": "pt"})
            if moments is not None:
                save_file(moments, tmp / OPTIMIZER, metadata={"steps": str(self.steps)})
            (tmp / MARKER).write_text(json.dumps({"kind": "full", "steps": self.steps,
                                                  "optimizer": "adamw"}))
            for f in tmp.iterdir():
                fsync_path(f)
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return sum(f.stat().st_size for f in path.iterdir())

    @torch.no_grad()
    def load(self, path: str | Path, optimizer: bool = True) -> AdapterInfo:
        """A full run's checkpoint into this run; everything is read and checked first.
        Every rank reads the files and keeps its own share of the state."""
        path = Path(path)
        if not is_full_checkpoint(path):
            raise EngineInputError("path", "not a full-parameter checkpoint (a LoRA adapter's "
                                   "cannot load into a rank-0 run)")
        weights = load_file(path / WEIGHTS)
        _check_names(weights, self.names, self.params, "weights")
        moments = None
        steps = 0
        if optimizer and (path / OPTIMIZER).is_file():
            moments = load_file(path / OPTIMIZER)
            _check_names(moments, [f"{k}.{n}" for k in "mv" for n in self.names],
                         self.params * 2, "optimizer state")
            steps = int(json.loads((path / MARKER).read_text()).get("steps", 0))
        for k, (n, p) in enumerate(zip(self.names, self.params, strict=True)):
            p.data.copy_(weights[n])
            if self.master[k] is None:
                continue
            self.master[k].copy_(weights[n])
            for kind, ts in (("m", self.m), ("v", self.v)):
                if moments is None:
                    ts[k].zero_()
                else:
                    ts[k].copy_(moments[f"{kind}.{n}"])
        for c in self.counters:
            c.fill_(float(steps))
        self.steps = steps
        self.zero_grad()
        return self.info()

    @torch.no_grad()
    def end(self) -> None:
        """Give the lane back its base model: the weights from its files, frozen again."""
        model = self.model
        model.hf.requires_grad_(False)
        self.zero_grad()
        model.fused, model.head = self._levers
        by_name = dict(zip(self.names, self.params, strict=True))
        for f in sorted(model.dir.glob("*.safetensors")):
            with safe_open(f, "pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if name in by_name:
                        by_name[name].data.copy_(fh.get_tensor(name))


class FullSlot:
    """An engine's place for one full run (`run`), and the sampler ids that view its weights
    (save_weights_for_sampler of it: nothing is copied). The run trains the engine's base
    model, so it starts only where no LoRA adapter is (`lora`: the engine's adapter ids)."""

    def __init__(self, model: BaseModel, dp_group=None):
        self.model, self.dp_group = model, dp_group
        self.run: FullRun | None = None
        self._views: set[str] = set()
        self._stale: set[str] = set()  # views of a run that ended: dropping them is a no-op

    def holds(self, adapter_id: str | None) -> bool:
        """Whether `adapter_id` is the run, or a view of its weights."""
        run = self.run
        return run is not None and (adapter_id == run.id or adapter_id in self._views)

    def start(self, run_id: str, config: LoraConfig, lora) -> AdapterInfo:
        if self.run is not None or lora:
            held = self.run.id if self.run is not None else sorted(lora)
            raise EngineInputError("lora_config.rank", "a full-parameter run needs its lane "
                                   f"alone; this one holds {held}")
        self.run = FullRun(run_id, self.model, config, self.dp_group)
        return self.run.info()

    def view(self, adapter_id: str) -> AdapterInfo:
        self._views.add(adapter_id)
        return self.run.info()

    def drop(self, adapter_id: str) -> bool | None:
        """Remove a view (False), or the run, giving the base model back (True); None:
        not one of ours."""
        if adapter_id in self._views:
            self._views.discard(adapter_id)
            return False
        if self.run is not None and adapter_id == self.run.id:
            self.run.end()
            self.run, self._stale, self._views = None, self._stale | self._views, set()
            return True
        if adapter_id in self._stale:
            self._stale.discard(adapter_id)
            return False
        return None

    def load(self, adapter_id: str, path: str | Path, optimizer: bool, new_full: bool,
             lora) -> AdapterInfo:
        """A full run's checkpoint: into the run (`new_full`: a training run's load, which
        starts one where there is none), or, for another id (a sampler of it), a view of
        the run's current weights; nothing else can hold one."""
        if new_full and self.run is None and not lora:
            self.start(adapter_id, LoraConfig(rank=0), lora)
        if self.run is not None and adapter_id == self.run.id:
            return self.run.load(path, optimizer)
        if self.run is not None:
            return self.view(adapter_id)
        raise EngineInputError("path", "a full-parameter checkpoint samples on the lane of "
                               "its live run, and loads only into a rank-0 run")


def owners(sizes: list[int], world: int) -> list[int]:
    """Each parameter's owning rank: largest first onto the least loaded (even shares)."""
    load, owner = [0] * world, [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[k] = r
        load[r] += sizes[k]
    return owner


def _check_names(tensors: dict, names, like, what: str) -> None:
    for n, w in zip(names, like, strict=True):
        t = tensors.get(n)
        if t is None or tuple(t.shape) != tuple(w.shape):
            raise EngineInputError("path", f"the checkpoint's {what} do not fit this model "
                                   f"({n}: {None if t is None else tuple(t.shape)} against "
                                   f"{tuple(w.shape)})")

