"""One co-batched forward/backward: many requests, many adapters, one pass per micro-batch.

Read top to bottom: rows are laid out so each bank's rows sit together, cut into
micro-batches under a token budget, run through the base model with every row's LoRA
(packed end to end without padding, packed.py, or as right-padded rows), scored with each
request's loss, and back-propagated once. Gradients land in the adapters'
bank buffers and wait there for each adapter's own optimizer step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from twinkled.protocol.types import ForwardBackwardRequest, ForwardBackwardResult

from .lora import Adapter, LoraBatch
from .losses import loss_spec
from .model import BaseModel
from .packed import PackedLora, Packing


@dataclass
class _Row:
    req: int  # index of the request
    datum: int  # index of the datum within it
    adapter: Adapter | None
    tokens: torch.Tensor  # [N] int64
    targets: torch.Tensor  # [N] int64, or [N, K]: K ids per position (top-K distillation)
    train: bool

    def view(self, t: torch.Tensor, k: int) -> torch.Tensor:
        """This row's part of a micro-batch tensor [B, S, K]: [N], or [N, K] if 2-D."""
        n = len(self.tokens)
        return t[k, :n, 0] if self.targets.dim() == 1 else t[k, :n, :self.targets.shape[1]]


class HostTime:
    """Host seconds spent issuing forward and backward passes and waiting for the device
    to finish them, summed until taken: the worker reports them for a step trace
    (twinkled/protocol/trace.py). Issuing near the waiting time means the pass is bound by kernel
    launches; waiting much longer than issuing means it is bound by the device."""

    def __init__(self) -> None:
        self._sums = [0.0, 0.0, 0.0]

    def add(self, forward: float, backward: float, wait: float) -> None:
        for i, v in enumerate((forward, backward, wait)):
            self._sums[i] += v

    def take(self) -> dict[str, float]:
        out = dict(zip(("forward", "backward", "device wait"), self._sums, strict=True))
        self._sums = [0.0, 0.0, 0.0]
        return out


HOST_TIME = HostTime()


def forward_backward(model: BaseModel, requests: list[ForwardBackwardRequest],
                     adapters: list[Adapter | None], token_budget: int,
                     packed: bool = True) -> list[ForwardBackwardResult]:
    """Run every request's data through the model; back-propagate the training ones.

    `adapters[i]` is request i's adapter (None: the base model). Inputs are validated
    before this is called: nothing here may fail half-way on bad input. `packed`: rows
    laid end to end (a micro-batch costs its tokens) rather than padded to the longest.
    """
    rows = [
        _Row(i, j, adapters[i], torch.as_tensor(d.tokens, dtype=torch.long),
             torch.as_tensor(d.loss_inputs["target_tokens"], dtype=torch.long),
             adapters[i] is not None and not req.forward_only)
        for i, req in enumerate(requests) for j, d in enumerate(req.data)
    ]
    outputs = [[None] * len(r.data) for r in requests]
    custom_metrics: dict[int, dict[str, float]] = {}

    for batch in _micro_batches(rows, requests, token_budget, packed):
        began = time.perf_counter()
        train = any(r.train for r in batch)
        with torch.set_grad_enabled(train):
            pack = packed and _padding(batch) > PACK_ABOVE
            lp = _packed_logprobs(model, batch) if pack else _logprobs(model, batch)
            elementwise = torch.zeros_like(lp, requires_grad=False)
            total = None
            for k, r in enumerate(batch):
                req = requests[r.req]
                if callable(req.loss_fn):
                    continue
                loss = _datum_loss(req, req.data[r.datum], r.view(lp, k))
                r.view(elementwise, k)[:] = loss.detach()
                if r.train:
                    total = loss.sum() if total is None else total + loss.sum()
            for i in sorted({r.req for r in batch if callable(requests[r.req].loss_fn)}):
                # A custom loss sees its whole request (kept in one micro-batch) at once.
                ks = [k for k, r in enumerate(batch) if r.req == i]
                lps = [batch[k].view(lp, k) for k in ks]
                loss, custom_metrics[i] = _custom_loss(requests[i], lps)
                # No per-token breakdown: the whole loss is reported on the first token.
                elementwise[ks[0], 0, 0] = loss.detach()
                if batch[ks[0]].train:
                    total = loss if total is None else total + loss
        forwarded = time.perf_counter()
        if total is not None and total.requires_grad:
            total.backward()
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
            adapters[i].pending += len(req.data)
    return results


# Pack a micro-batch when padding would be more than this share of it; rows of (nearly)
# one length run padded, as batched matmuls, which costs less host time than grouped ones.
PACK_ABOVE = 0.1


def _padding(batch: list[_Row]) -> float:
    """The share of a padded micro-batch that would be padding."""
    lengths = [len(r.tokens) for r in batch]
    return 1 - sum(lengths) / (max(lengths) * len(lengths))


def _micro_batches(rows: list[_Row], requests, token_budget: int,
                   packed: bool) -> list[list[_Row]]:
    """Bank-contiguous order (base rows first), cut so the tokens a micro-batch holds
    (packed: its tokens; padded: rows x the longest) stay under budget.

    A custom-loss request is kept whole in one micro-batch: its loss may couple datums.
    """
    def order(r: _Row):
        a = r.adapter
        return (0, (), 0) if a is None else (1, a.bank.order, a.slot)

    rows = sorted(rows, key=order)
    custom = {i for i, q in enumerate(requests) if callable(q.loss_fn)}
    batches: list[list[_Row]] = []
    current: list[_Row] = []
    longest = held = 0
    for r in (r for r in rows if r.req not in custom):
        n = len(r.tokens)
        size = held + n if packed else max(longest, n) * (len(current) + 1)
        if current and size > token_budget:
            batches.append(current)
            current, longest, held = [], 0, 0
        current.append(r)
        longest, held = max(longest, n), held + n
    if current:
        batches.append(current)
    for i in sorted(custom):
        batches.append([r for r in rows if r.req == i])
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
    lora = LoraBatch([r.adapter for r in batch], model.dtype, dev)
    hidden = model.forward(ids, positions, lora)
    return model.target_logprobs(hidden, tgt, lora)


def _packed_logprobs(model: BaseModel, batch: list[_Row]) -> torch.Tensor:
    """The micro-batch as one sequence of all its tokens (packed.py); returns the target
    logprobs in the row layout [B, S, K] the losses read (zero past each row's end)."""
    dev = model.device
    lengths = [len(r.tokens) for r in batch]
    S = max(lengths)
    K = max(r.targets.shape[1] if r.targets.dim() == 2 else 1 for r in batch)
    ids = torch.cat([r.tokens for r in batch])[None].to(dev, non_blocking=True)
    tgt = torch.zeros((sum(lengths), K), dtype=torch.long)
    start = 0
    for r, n in zip(batch, lengths, strict=True):
        tgt[start:start + n, :r.targets.shape[1] if r.targets.dim() == 2 else 1] = (
            r.targets.view(n, -1))
        start += n
    packing = Packing.of(lengths, dev)
    lora = PackedLora([(r.adapter, n) for r, n in zip(batch, lengths, strict=True)],
                      model.dtype, dev)
    hidden = model.forward(ids, packing.positions, lora, packing=packing)
    lp = model.target_logprobs(hidden, tgt.to(dev, non_blocking=True)[None], lora)[0]
    row = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(lengths)).to(dev)
    return lp.new_zeros((len(batch), S, K)).index_put((row, packing.positions[0]), lp)


def _datum_loss(req: ForwardBackwardRequest, datum, lp: torch.Tensor) -> torch.Tensor:
    """One datum's built-in elementwise loss [N].

    A loss function sees one datum (one sampled sequence) at a time, whether its micro-batch
    ran padded or packed: a sequence-level loss (gspo's ratio) is taken over exactly it."""
    inputs = {k: torch.as_tensor(v, dtype=torch.float32).to(lp.device, non_blocking=True)
              for k, v in datum.loss_inputs.items() if k != "target_tokens"}
    return loss_spec(req.loss_fn).fn(lp, inputs, req.loss_config)


def _custom_loss(req: ForwardBackwardRequest, lps: list[torch.Tensor]):
    """A Python callable's loss over the whole request: (data, logprobs) -> (loss, metrics)."""
    loss, metrics = req.loss_fn(req.data, lps)
    return loss, {k: float(v) for k, v in metrics.items() if k != "loss:sum"}
