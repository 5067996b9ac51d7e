"""The last sampling calls of each training run, for the console's run page: what was asked
(the prompt's token ids) and what came back (each sequence's tokens, the sum of its
logprobs, why it stopped), with the time and the tenant that asked.

Kept in memory only, bounded four ways (calls per run, runs, sequences per call, ids per
prompt and per sequence): a look at what a run samples now, not a log; a restart forgets them. Token
ids are kept, not text: the console decodes them with the model's tokenizer when a page
asks (off the event loop), so sampling pays no tokenizer cost.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from twinkled.core.ops import After
from twinkled.protocol.frames import SampleF

# Bounds: at most PER_RUN * RUNS calls of (MAX_PROMPT + MAX_SEQUENCES * MAX_SEQUENCE)
# 4-byte ids, some 42 MB, whatever the clients sample.
PER_RUN = 16  # calls kept per run
RUNS = 256  # runs kept (the least recently sampled go first)
MAX_PROMPT = 512  # ids of a prompt kept (its end)
MAX_SEQUENCE = 512  # ids of a sampled sequence kept (its start)
MAX_SEQUENCES = 4  # of one call (num_samples may be more)


@dataclass
class _Sequence:
    tokens: array  # its first MAX_SEQUENCE ids
    tokens_n: int
    logprob_sum: float
    stop_reason: str


@dataclass
class _Call:
    time: float
    tenant: str
    sampler: str
    prompt: array  # the prompt's last MAX_PROMPT ids
    prompt_tokens: int  # its whole length
    sequences: list[_Sequence]
    num_samples: int

    def as_dict(self) -> dict[str, Any]:
        return {"time": self.time, "tenant": self.tenant, "sampler": self.sampler,
                "prompt": self.prompt.tolist(), "prompt_tokens": self.prompt_tokens,
                "num_samples": self.num_samples,
                "sequences": [{"tokens": s.tokens.tolist(), "tokens_n": s.tokens_n,
                               "logprob_sum": s.logprob_sum, "stop_reason": s.stop_reason}
                              for s in self.sequences]}


def run_of_path(path: str | None) -> str | None:
    """The run a checkpoint path (`tinker://RUN/kind/name`) belongs to; None for the base
    model (a sampler made from no checkpoint)."""
    if not path or not path.startswith("tinker://"):
        return None
    return path.removeprefix("tinker://").split("/", 1)[0] or None


class RecentSamples:
    """A ring of the last `per_run` calls per run, for at most `runs` runs."""

    def __init__(self, per_run: int = PER_RUN, runs: int = RUNS) -> None:
        self._per_run, self._runs = per_run, runs
        self._rings: OrderedDict[str, deque[_Call]] = OrderedDict()

    def recorder(self, tenant: str, path: str | None, sampler: str, frame: SampleF,
                 then: After | None = None) -> After | None:
        """An op's `after` that keeps the call once it succeeded, after running `then`
        (the op's own); just `then` for a sample of the base model (no run to show it on)."""
        run = run_of_path(path)
        if run is None:
            return then

        def after(result: Any, message: str | None) -> None:
            if then is not None:
                then(result, message)
            if message is None and result is not None:
                self.put(run, tenant, sampler, frame.prompt.values(), result.sequences)
        return after

    def put(self, run: str, tenant: str, sampler: str, prompt: list[int],
            sequences: list) -> None:
        seqs = [_Sequence(array("i", s.tokens[:MAX_SEQUENCE]), len(s.tokens),
                          float(sum(s.logprobs)), s.stop_reason)
                for s in sequences[:MAX_SEQUENCES]]
        ring = self._rings.pop(run, None) or deque(maxlen=self._per_run)
        ring.append(_Call(time.time(), tenant, sampler, array("i", prompt[-MAX_PROMPT:]),
                          len(prompt), seqs, len(sequences)))
        self._rings[run] = ring  # the most recently sampled run last
        while len(self._rings) > self._runs:
            self._rings.popitem(last=False)

    def of_run(self, run: str, tenant: str | None) -> list[dict[str, Any]]:
        """The run's kept calls, newest first; only `tenant`'s (None: everyone's). Another
        tenant may sample a public checkpoint of the run: its prompts are not the run
        owner's to read."""
        calls = reversed(self._rings.get(run, ()))
        return [c.as_dict() for c in calls if tenant is None or c.tenant == tenant]
