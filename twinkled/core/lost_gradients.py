"""An optimizer step never applies gradients that are missing a failed forward_backward.

A pipelining client (tinker's) sends its optim_step right behind its forward_backward,
before it hears how the forward_backward went. When that forward_backward fails after it was
queued (its worker was killed, or its pass failed in the engine), its gradients are gone:
the adapter is back at its acknowledged state. The optim_step queued behind it would run on
what is left (nothing, most often) and be answered as done, and the client, told only that
its forward_backward failed, would redo that alone: a step of its run silently lost.

So the model's next optim_step fails with it (same category: "server" when a worker was lost,
so the client redoes both), whenever it arrives: the client's HTTP request for it may reach
the daemon well after the forward_backward failed (seen under load in CI), and it was still
sent blind. What clears the failure is a training forward_backward that arrived after it
failed and succeeded (the client heard, and redid it): the optim_step behind that runs.
(A client that heard and sends an optim_step with no forward_backward before it is told to
submit the forward_backward again: Adam's step on no gradients is not what anyone meant.)
A stop of the daemon forgets none of it: at start-up each run whose last training op failed
(or was cut short by the stop) is failed here again (store/futures.py, failed_training).
Torch-free; the core (completion.py) asks it of each planned optim_step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Failed:
    seq: int  # the forward_backward that failed
    last_queued: int  # the model's last seq_id queued when it failed (all sent blind)
    why: str
    category: str


class LostGradients:
    def __init__(self) -> None:
        self._failed: dict[str, _Failed] = {}  # model -> its latest failed forward_backward

    def failed(self, model: str, seq: int, last_queued: int, why: str, category: str) -> None:
        """Training forward_backward `seq` of `model` failed after it was queued; the model
        had queued up to `last_queued` then (what its client sent before it heard)."""
        known = self._failed.get(model)
        if known is not None and known.seq < seq <= known.last_queued:
            # a later one of the same batch sent blind: the pending optim_step still fails
            known.last_queued = max(known.last_queued, last_queued)
            return
        self._failed[model] = _Failed(seq, last_queued, why, category)

    def trained(self, model: str, seq: int) -> None:
        """Training forward_backward `seq` of `model` succeeded. One that arrived after the
        failure (the client's redo) clears it; one queued before it (a blind one of the same
        batch) does not: the gradients of the failed one are still missing."""
        known = self._failed.get(model)
        if known is not None and seq > known.last_queued:
            del self._failed[model]

    def check(self, model: str, seq: int) -> tuple[str, str] | None:
        """(message, category) if optim_step `seq` of `model` must fail: it comes behind a
        forward_backward that failed, with no redo of it in between (once per failure)."""
        known = self._failed.get(model)
        if known is None or seq <= known.seq:
            return None
        del self._failed[model]
        # The action first: clients and logs may show only the start of a message.
        return (f"submit forward_backward seq_id {known.seq} again, then this optim_step: "
                f"optim_step seq_id {seq} of {model} did not run, as the forward_backward "
                f"ahead of it failed ({known.why}) and its gradients are not there",
                known.category)

    def settled(self, model: str, seq: int) -> None:
        """Optim_step `seq` of `model` was answered (it failed in the same step as the
        forward_backward, say): the failure ahead of it is accounted for."""
        known = self._failed.get(model)
        if known is not None and known.seq < seq:
            del self._failed[model]

    def forget(self, model: str) -> None:
        self._failed.pop(model, None)
