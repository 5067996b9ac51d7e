"""Stability records: what the sampler produced, kept for the `stable_reinforce` loss.

A sample request with `record_stability_info=True` leaves one record per sampled sequence,
under the `sequence_id` its client was given: the prompt, the sampled tokens and the
sampler's logprob of each. A later `forward_backward` with `loss_fn="stable_reinforce"`
names those sequences in each datum's provenance spans; `resolve` checks every claim the
spans make against the records and turns them into the loss's two recorded inputs.

Tinker's rules, as its docs state them: records belong to the session that sampled them
(so here to that tenant and session: anyone else is told the id does not exist), and "can
be trained on for one day after sampling. Each training request that uses a sequence
restarts that day." Memory is bounded: each tenant has a byte budget and the whole book
another; past either, the least recently used records go first, the tenant's own before
anyone else's. Records live in the daemon's memory only: after a restart a sequence is
unknown (the error says to sample again).
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from twinkled.protocol.checks import fail

DAY_S = 86400.0


class Span(Protocol):
    """One provenance run: `length` datum positions are positions [offset, offset+length)
    of the named sequence's prompt (`kind` "prompt") or sampled tokens ("sampled")."""

    kind: str
    sequence_id: str
    offset: int
    length: int


@dataclass
class Record:
    tenant: str
    session: str
    prompt: array  # int32 token ids
    tokens: array  # int32, the sampled tokens
    logprobs: array  # float32, the sampler's logprob of each sampled token
    used: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return 4 * (len(self.prompt) + len(self.tokens) + len(self.logprobs)) + 200

    def run(self, span: Span) -> array:
        return self.prompt if span.kind == "prompt" else self.tokens


class StabilityRecords:
    def __init__(self, max_bytes: int = 256 * 2**20, tenant_bytes: int = 64 * 2**20,
                 ttl_s: float = DAY_S, clock=time.monotonic):
        self.max_bytes, self.tenant_bytes, self.ttl_s = max_bytes, tenant_bytes, ttl_s
        self.clock = clock
        self._records: OrderedDict[str, Record] = OrderedDict()  # least recently used first
        self._owned: dict[str, OrderedDict[str, None]] = {}  # the same order, per tenant
        self._bytes = 0
        self._tenant_bytes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._records)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, tenant: str, session: str, ids: Sequence[str], prompt: Sequence[int],
            sequences: Sequence) -> None:
        """Record the sequences of one sample request (`ids[i]` names `sequences[i]`, which
        has `tokens` and `logprobs`)."""
        self._expire()
        # One copy of the prompt for the request's samples (each record still counts it,
        # so the budgets err on the safe side).
        shared = array("i", prompt)
        owned = self._owned.setdefault(tenant, OrderedDict())
        for sid, seq in zip(ids, sequences, strict=True):
            self._drop(sid)
            rec = Record(tenant, session, shared, array("i", seq.tokens),
                         array("f", seq.logprobs), self.clock())
            self._records[sid] = rec
            owned[sid] = None
            self._bytes += rec.nbytes
            self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + rec.nbytes
        self._evict(tenant)

    def resolve(self, tenant: str, session: str, where: str, tokens: Sequence[int],
                targets: Sequence[int], model_spans: Sequence[Span] | None,
                loss_spans: Sequence[Span] | None) -> tuple[list[float], list[int]]:
        """(sampler_logprobs, sampled_mask) for one datum, from the records its spans name.

        Every claim is checked: the spans tile the input and the targets, each names a
        sequence this tenant's session recorded, and the tokens they cover are the recorded
        ones. A false claim is an error naming the span (`where` is e.g. "data[3]")."""
        self._expire()
        if model_spans is None or loss_spans is None:
            raise fail(f"{where}.loss_fn_input_spans",
                       "stable_reinforce needs provenance on every datum: name the sampled "
                       "sequences behind its tokens (Datum.with_provenance) and sample with "
                       "record_stability_info=True")
        self._check_claims(tenant, session, f"{where}.model_input_spans", model_spans, tokens)
        # A target at a prompt position carries no loss (no advantage may ride on it), and
        # the cookbook's rl_loop pads those targets with 0: only the sampled ones must match.
        self._check_claims(tenant, session, f"{where}.loss_fn_input_spans", loss_spans, targets,
                           kinds=("sampled",))
        logprobs: list[float] = []
        mask: list[int] = []
        now = self.clock()
        for span in loss_spans:
            rec = self._records[span.sequence_id]
            rec.used = now  # a training request restarts the record's day
            self._records.move_to_end(span.sequence_id)
            self._owned[tenant].move_to_end(span.sequence_id)
            if span.kind == "sampled":
                logprobs.extend(rec.logprobs[span.offset:span.offset + span.length])
                mask.extend([1] * span.length)
            else:  # the sampler recorded nothing about its prompt
                logprobs.extend([0.0] * span.length)
                mask.extend([0] * span.length)
        return logprobs, mask

    def _check_claims(self, tenant: str, session: str, field_name: str, spans: Sequence[Span],
                      values: Sequence[int], kinds: tuple[str, ...] = ("prompt", "sampled"),
                      ) -> None:
        """Each span names a record of this session, lies within it, and (for `kinds`)
        covers exactly the recorded tokens."""
        covered = sum(s.length for s in spans)
        if covered != len(values):
            raise fail(field_name, f"spans cover {covered} positions but the field has "
                       f"{len(values)}: the runs must tile it exactly")
        pos = 0
        for k, span in enumerate(spans):
            where = f"{field_name}[{k}]"
            rec = self._records.get(span.sequence_id)
            if rec is None or rec.tenant != tenant or rec.session != session:
                raise fail(f"{where}.sequence_id",
                           f"no recorded sequence {span.sequence_id!r} in this session: sample "
                           "with record_stability_info=True (records last a day without use, "
                           "and not across a daemon restart)")
            run = rec.run(span)
            if span.offset + span.length > len(run):
                raise fail(where, f"offset {span.offset} + length {span.length} is past the "
                           f"{len(run)} {span.kind} tokens of {span.sequence_id!r}")
            claimed = values[pos:pos + span.length]
            if (span.kind in kinds
                    and list(claimed) != run[span.offset:span.offset + span.length].tolist()):
                raise fail(where, f"the tokens it covers are not {span.kind} tokens "
                           f"{span.offset}..{span.offset + span.length - 1} of "
                           f"{span.sequence_id!r}")
            pos += span.length

    def _drop(self, sid: str) -> None:
        rec = self._records.pop(sid, None)
        if rec is not None:
            del self._owned[rec.tenant][sid]
            self._bytes -= rec.nbytes
            self._tenant_bytes[rec.tenant] -= rec.nbytes

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        while self._records:
            sid, rec = next(iter(self._records.items()))
            if rec.used >= cutoff:
                return
            self._drop(sid)

    def _evict(self, tenant: str) -> None:
        """Over the tenant's budget: its own oldest go. Over the book's: the oldest of all."""
        owned = self._owned.get(tenant, {})
        while self._tenant_bytes.get(tenant, 0) > self.tenant_bytes and owned:
            self._drop(next(iter(owned)))
        while self._bytes > self.max_bytes and self._records:
            self._drop(next(iter(self._records)))
