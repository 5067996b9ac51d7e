"""One co-batched forward/backward: many requests, many adapters, one pass per micro-batch.

Read top to bottom: rows are laid out so each bank's rows sit together, rows of one
adapter that begin alike grouped to compute their common start once (shared_prefix.py),
cut into micro-batches under a token budget, run through the base model with every row's
LoRA (packed end to end without padding, packed.py, or as right-padded rows), scored with
each request's loss, and back-propagated once. Gradients land in the adapters'
bank buffers and wait there for each adapter's own optimizer step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from twinkled.protocol.types import ForwardBackwardRequest, ForwardBackwardResult

from . import vision
from .context_parallel import ContextParallel, cp_batches, cp_logprobs
from .lora import Adapter, LoraBatch
from .losses import loss_spec
from .model import BaseModel
from .packed import PackedLora
from .shared_prefix import MIN_SHARED, TOKENS, Group, Layout, group_rows, split_group


@dataclass
class _Row:
    req: int  # index of the request
    datum: int  # index of the datum within it
    adapter: Adapter | None
    tokens: torch.Tensor  # [N] int64
    targets: torch.Tensor  # [N] int64, or [N, K]: K ids per position (top-K distillation)
    train: bool
    images: tuple = ()  # protocol/images.PreparedImage, a VL model's (vision.py)

    def view(self, t: torch.Tensor, k: int) -> torch.Tensor:
        """This row's part of a micro-batch tensor [B, S, K]: [N], or [N, K] if 2-D."""
        n = len(self.tokens)
        return t[k, :n, 0] if self.targets.dim() == 1 else t[k, :n, :self.targets.shape[1]]


class HostTime:
    """Host seconds spent issuing forward and backward passes and waiting for the device
    to finish them, summed until taken: the worker reports them for a step trace
    (twinkled/protocol/trace.py). Issuing near the waiting time means the pass is bound by kernel
    launches; waiting much longer than issuing means it is bound by the device. The
    running batch notes its decode steps, their rows and its prefill and decode seconds
    here too (`note`), so a trace shows how full a sampling slice's steps were."""

    KEYS = ("forward", "backward", "device wait")

    def __init__(self) -> None:
        self._sums = dict.fromkeys(self.KEYS, 0.0)

    def add(self, forward: float, backward: float, wait: float) -> None:
        self.note(forward=forward, backward=backward, **{"device wait": wait})

    def note(self, **sums: float) -> None:
        for k, v in sums.items():
            self._sums[k] = self._sums.get(k, 0.0) + v

    def take(self) -> dict[str, float]:
        out, self._sums = self._sums, dict.fromkeys(self.KEYS, 0.0)
        return out


HOST_TIME = HostTime()


def forward_backward(model: BaseModel, requests: list[ForwardBackwardRequest],
                     adapters: list[Adapter | None], token_budget: int,
                     packed: bool = True, shared_prefix: int = MIN_SHARED,
                     between: Callable[[], None] | None = None,
                     cp: ContextParallel | None = None, base_trains: bool = False
                     ) -> list[ForwardBackwardResult]:
    """Run every request's data through the model; back-propagate the training ones.

    `adapters[i]` is request i's adapter (None: the base model). Inputs are validated
    before this is called: nothing here may fail half-way on bad input. `packed`: rows
    laid end to end (a micro-batch costs its tokens) rather than padded to the longest.
    `shared_prefix`: packed rows of one adapter whose first this many positions (tokens and
    targets) agree compute their common start once (shared_prefix.py); 0: never.
    `between`: called after each micro-batch but the last, once its backward is done (the
    step is preemptible there: the worker runs newly arrived small work of other adapters,
    which touches none of this step's gradients).
    `cp`: rows it splits run over the context-parallel group (context_parallel.py), in
    micro-batches of their own before the others; every rank of the group is given the
    same split rows, and each reports them whole (the caller keeps one rank's word).
    `base_trains`: rows without an adapter train the base model's own weights (a
    full-parameter run, full_param.py: their gradients land in the weights' `.grad`).
    """
    rows = [
        _Row(i, j, adapters[i], torch.as_tensor(d.tokens, dtype=torch.long),
             torch.as_tensor(d.loss_inputs["target_tokens"], dtype=torch.long),
             (adapters[i] is not None or base_trains) and not req.forward_only,
             tuple(getattr(d, "images", ())))
        for i, req in enumerate(requests) for j, d in enumerate(req.data)
    ]
    if any(r.images for r in rows):  # equal tokens are not an equal start with images
        shared_prefix = 0
    outputs = [[None] * len(r.data) for r in requests]
    custom_metrics: dict[int, dict[str, float]] = {}

    split = [r for r in rows if cp is not None and cp.splits(len(r.tokens))
             and not callable(requests[r.req].loss_fn) and not r.images]
    if split:
        gone = {id(r) for r in split}
        rows = [r for r in rows if id(r) not in gone]
    batches: list = cp_batches(cp, split, _order, token_budget) if split else []
    n_split = len(batches)
    batches += _micro_batches(rows, requests, token_budget, packed, shared_prefix)
    for n, groups in enumerate(batches):
        if n and between is not None:
            between()
        began = time.perf_counter()
        whole = n < n_split  # a micro-batch of split rows: a list of rows, not of groups
        batch = groups if whole else [r for g in groups for r in g.rows]
        train = any(r.train for r in batch)
        inputs = _loss_inputs(requests, batch, model.device)
        # A split row's loss counts once in the group (on its rank 0); the others take it
        # times zero, so that their backward runs the same collectives (context_parallel.py).
        weight = 1.0 if not whole or cp.rank == 0 else 0.0
        with torch.set_grad_enabled(train):
            # A shared start exists only in the packed layout.
            pack = not whole and packed and (any(g.shared for g in groups)
                                             or _padding(batch) > PACK_ABOVE)
            if whole:
                lp = cp_logprobs(model, cp, batch)
            else:
                lp = _packed_logprobs(model, groups) if pack else _logprobs(model, batch)
            real = sum(len(r.tokens) for r in batch)
            if whole:
                real = -(-real // cp.size)  # this rank's share
            TOKENS.add(real, sum(g.cost for g in groups) if pack else real)
            elementwise = torch.zeros_like(lp, requires_grad=False)
            total = None
            for k, r in enumerate(batch):
                req = requests[r.req]
                if callable(req.loss_fn):
                    continue
                loss = _datum_loss(req, inputs[k], r.view(lp, k))
                r.view(elementwise, k)[:] = loss.detach()
                if r.train:
                    part = loss.sum() * weight if whole else loss.sum()
                    total = part if total is None else total + part
            for i in sorted({r.req for r in batch if callable(requests[r.req].loss_fn)}):
                # A custom loss sees its whole request (kept in one micro-batch) at once.
                # In datum order (a micro-batch may hold rows in another: shared_prefix.py)
                ks = sorted((k for k, r in enumerate(batch) if r.req == i),
                            key=lambda k: batch[k].datum)
                lps = [batch[k].view(lp, k) for k in ks]
                loss, custom_metrics[i] = _custom_loss(requests[i], lps)
                # No per-token breakdown: the whole loss is reported on the first token.
                elementwise[ks[0], 0, 0] = loss.detach()
                if batch[ks[0]].train:
                    total = loss if total is None else total + loss
        forwarded = time.perf_counter()
        if total is not None and total.requires_grad:
            total.backward()
            for bank in {id(r.adapter.bank): r.adapter.bank for r in batch
                         if r.train and r.adapter is not None}.values():
                bank.flush()  # the gradients the backward left in its scratch
        backwarded = time.perf_counter()
        lp_host, el_host = lp.detach().cpu(), elementwise.cpu()  # one copy per micro-batch
        HOST_TIME.add(forwarded - began, backwarded - forwarded, time.perf_counter() - backwarded)
        for k, r in enumerate(batch):
            outputs[r.req][r.datum] = {"logprobs": r.view(lp_host, k),
                                       "elementwise_loss": r.view(el_host, k)}

    results = []
    for i, req in enumerate(requests):
        metrics = {"loss:sum": float(sum(o["elementwise_loss"].sum() for o in outputs[i]))}
        metrics.update(custom_metrics.get(i, {}))
        results.append(ForwardBackwardResult(outputs=outputs[i], metrics=metrics))
        if adapters[i] is not None and not req.forward_only:
            # a split row counts once in the group, as its gradient does
            adapters[i].pending += len(req.data) - (
                sum(1 for r in split if r.req == i) if split and cp.rank else 0)
    return results


# Pack a micro-batch when padding would be more than this share of it; rows of (nearly)
# one length run padded, as batched matmuls, which costs less host time than grouped ones.
PACK_ABOVE = 0.1


def _padding(batch: list[_Row]) -> float:
    """The share of a padded micro-batch that would be padding."""
    lengths = [len(r.tokens) for r in batch]
    return 1 - sum(lengths) / (max(lengths) * len(lengths))


def _order(r: _Row):
    """Bank-contiguous order: base rows first, then each bank's adapters by slot."""
    a = r.adapter
    return (0, (), 0) if a is None else (1, a.bank.order, a.slot)


def _micro_batches(rows: list[_Row], requests, token_budget: int, packed: bool,
                   min_shared: int) -> list[list[Group]]:
    """Bank-contiguous order (base rows first), grouped where rows share a start (packed
    only), cut so the tokens a micro-batch computes (packed: its tokens, a shared start
    once; padded: rows x the longest) stay under budget. A group that does not fit is cut
    between its rows, each part computing the shared start again.

    A custom-loss request is kept whole in one micro-batch: its loss may couple datums.
    """
    rows = sorted(rows, key=_order)
    min_shared = min_shared if packed else 0
    custom = {i for i, q in enumerate(requests) if callable(q.loss_fn)}
    batches: list[list[Group]] = []
    current: list[Group] = []
    longest = held = 0
    for rest in group_rows([r for r in rows if r.req not in custom], min_shared):
        while rest is not None:
            if packed:
                part, rest = split_group(rest, token_budget - held, token_budget)
            else:  # one row per group here
                n = len(rest.rows[0].tokens)
                fits = not current or max(longest, n) * (len(current) + 1) <= token_budget
                part, rest = (rest, None) if fits else (Group([]), rest)
            if not part.rows:  # nothing more fits: the next micro-batch
                batches.append(current)
                current, longest, held = [], 0, 0
                continue
            current.append(part)
            longest = max(longest, *(len(r.tokens) for r in part.rows))
            held += part.cost
    if current:
        batches.append(current)
    for i in sorted(custom):
        batches.append(group_rows([r for r in rows if r.req == i], min_shared))
    return batches


def _logprobs(model: BaseModel, batch: list[_Row]) -> torch.Tensor:
    """Right-padded forward of a micro-batch; returns the target logprobs [B, S, K] (fp32;
    K is 1 unless a row has several targets per position)."""
    S = max(len(r.tokens) for r in batch)
    K = max(r.targets.shape[1] if r.targets.dim() == 2 else 1 for r in batch)
    dev = model.device
    ids = torch.zeros((len(batch), S), dtype=torch.long)
    tgt = torch.zeros((len(batch), S, K), dtype=torch.long)
    for k, r in enumerate(batch):
        ids[k, : len(r.tokens)] = r.tokens
        r.view(tgt, k)[:] = r.targets
    ids, tgt = ids.to(dev, non_blocking=True), tgt.to(dev, non_blocking=True)
    positions = torch.arange(S, device=dev).expand(len(batch), S)
    positions, images = vision.batch_inputs(model, batch, S, dev) or (positions, None)
    lora = LoraBatch([r.adapter for r in batch], model.dtype, dev)
    hidden = model.forward(ids, positions, lora, images=images)
    return model.target_logprobs(hidden, tgt, lora)


def _packed_logprobs(model: BaseModel, groups: list[Group]) -> torch.Tensor:
    """The micro-batch as one sequence of all its tokens (packed.py), a group's shared
    start once (shared_prefix.py); returns the target logprobs in the row layout [B, S, K]
    the losses read (zero past each row's end)."""
    dev = model.device
    layout = Layout.of(groups, dev)
    ids = layout.ids[None].to(dev, non_blocking=True)
    lora = PackedLora(layout.segments, model.dtype, dev)
    rows = [r for g in groups for r in g.rows]  # (packed in this order: no shared starts)
    positions, images = (vision.batch_inputs(model, rows, None, dev)
                         or (layout.packing.positions, None))
    hidden = model.forward(ids, positions, lora, packing=layout.packing, images=images)
    lp = model.target_logprobs(hidden, layout.targets.to(dev, non_blocking=True)[None], lora)[0]
    return layout.unpack(lp)


def _loss_inputs(requests: list[ForwardBackwardRequest], batch: list[_Row], device
                 ) -> list[dict[str, torch.Tensor]]:
    """Each row's loss inputs but its targets (weights, advantages, sampler logprobs...)
    in fp32 on the device, in one copy for the micro-batch, made before its forward is
    queued: a copy from pageable host memory waits for the device's queue, so one per
    input per row after the forward stalled the host until the forward had run."""
    parts: list[torch.Tensor] = []
    where: list[dict[str, tuple[int, torch.Size]]] = []
    for r in batch:
        req, names = requests[r.req], {}
        if not callable(req.loss_fn):
            for k, v in req.data[r.datum].loss_inputs.items():
                if k != "target_tokens":
                    t = torch.as_tensor(v, dtype=torch.float32)
                    names[k] = (len(parts), t.shape)
                    parts.append(t.reshape(-1))
        where.append(names)
    if not parts:
        return where  # (all empty)
    pieces = torch.cat(parts).to(device, non_blocking=True).split([len(p) for p in parts])
    return [{k: pieces[i].view(shape) for k, (i, shape) in w.items()} for w in where]


def _datum_loss(req: ForwardBackwardRequest, inputs: dict[str, torch.Tensor],
                lp: torch.Tensor) -> torch.Tensor:
    """One datum's built-in elementwise loss [N], from its loss inputs on the device.

    A loss function sees one datum (one sampled sequence) at a time, whether its micro-batch
    ran padded or packed: a sequence-level loss (gspo's ratio) is taken over exactly it."""
    return loss_spec(req.loss_fn).fn(lp, inputs, req.loss_config)


def _custom_loss(req: ForwardBackwardRequest, lps: list[torch.Tensor]):
    """A Python callable's loss over the whole request: (data, logprobs) -> (loss, metrics)."""
    loss, metrics = req.loss_fn(req.data, lps)
    return loss, {k: float(v) for k, v in metrics.items() if k != "loss:sum"}
