"""The daemon's records of sampled sequences for stable_reinforce (twinkled/core/stability.py):
every provenance claim is checked, records are private to a tenant's session, a day without
use forgets one, and memory stays within its budgets."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tinker_shim.codec import SpanIn
from twinkled.core.stability import StabilityRecords
from twinkled.protocol.types import EngineInputError, SampledSequence

PROMPT = [11, 12, 13]
SAMPLED = SampledSequence([21, 22, 23, 24], [-0.5, -1.25, -2.0, -0.125], "stop")


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def book(**kw) -> StabilityRecords:
    b = StabilityRecords(clock=kw.pop("clock", Clock()), **kw)
    b.put("alice", "sess-a", ["s:0"], PROMPT, [SAMPLED])
    return b


def cookbook_datum(sid: str = "s:0"):
    """The datum tinker-cookbook's rl_loop builds: the input is the prompt plus all but the
    last sampled token; the targets start at the prompt's second token."""
    tokens = PROMPT + SAMPLED.tokens[:-1]
    targets = PROMPT[1:] + SAMPLED.tokens
    model = [SpanIn("prompt", sid, 0, 3), SpanIn("sampled", sid, 0, 3)]
    loss = [SpanIn("prompt", sid, 1, 2), SpanIn("sampled", sid, 0, 4)]
    return tokens, targets, model, loss


def test_resolve_gives_recorded_logprobs_on_sampled_positions():
    q, mask = book().resolve("alice", "sess-a", "data[0]", *cookbook_datum())
    assert mask == [0, 0, 1, 1, 1, 1]
    assert q == [0.0, 0.0, -0.5, -1.25, -2.0, -0.125]


def test_prompt_targets_may_be_padding_but_inputs_must_be_real():
    """rl_loop pads the prompt's targets with 0 (they carry no loss); the model input it
    claims to have taken from the prompt must be the prompt."""
    tokens, targets, model, loss = cookbook_datum()
    padded = [0, 0] + targets[2:]
    book().resolve("alice", "sess-a", "data[0]", tokens, padded, model, loss)
    with pytest.raises(EngineInputError, match=r"data\[0\].model_input_spans\[0\]: the tokens "
                       "it covers are not prompt tokens 0..2 of 's:0'"):
        book().resolve("alice", "sess-a", "data[0]", [0] + tokens[1:], targets, model, loss)


@pytest.mark.parametrize(("tenant", "session"), [("bob", "sess-a"), ("alice", "sess-b")])
def test_another_tenant_or_session_sees_nothing(tenant, session):
    with pytest.raises(EngineInputError, match=r"data\[0\].model_input_spans\[0\].sequence_id: "
                       "no recorded sequence 's:0' in this session"):
        book().resolve(tenant, session, "data[0]", *cookbook_datum())


def _broken(case):
    tokens, targets, model, loss = cookbook_datum()
    if case == "no spans":
        return tokens, targets, None, None
    if case == "short tiling":
        return tokens, targets, model, loss[:1]
    if case == "wrong token":
        return tokens, targets[:-1] + [99], model, loss
    if case == "past the end":
        return tokens, targets, model, [loss[0], SpanIn("sampled", "s:0", 1, 4)]
    if case == "unknown id":
        return tokens, targets, model, [loss[0], SpanIn("sampled", "s:9", 0, 4)]
    raise AssertionError(case)


@pytest.mark.parametrize(("case", "pattern"), [
    ("no spans", r"data\[2\].loss_fn_input_spans: stable_reinforce needs provenance"),
    ("short tiling", r"data\[2\].loss_fn_input_spans: spans cover 2 positions but the field "
     "has 6"),
    ("wrong token", r"data\[2\].loss_fn_input_spans\[1\]: the tokens it covers are not "
     "sampled tokens 0..3 of 's:0'"),
    ("past the end", r"loss_fn_input_spans\[1\]: offset 1 \+ length 4 is past the 4 sampled"),
    ("unknown id", r"loss_fn_input_spans\[1\].sequence_id: no recorded sequence 's:9'"),
])
def test_false_claims_are_refused_naming_the_span(case, pattern):
    with pytest.raises(EngineInputError, match=pattern):
        book().resolve("alice", "sess-a", "data[2]", *_broken(case))


def test_a_day_without_use_forgets_and_use_restarts_the_day():
    clock = Clock()
    b = book(clock=clock)
    b.put("alice", "sess-a", ["s:1"], PROMPT, [SAMPLED])
    clock.now += 80000
    b.resolve("alice", "sess-a", "data[0]", *cookbook_datum("s:1"))  # used: a new day
    clock.now += 10000  # s:0 is now 25 hours unused, s:1 only 3
    with pytest.raises(EngineInputError, match="no recorded sequence 's:0'"):
        b.resolve("alice", "sess-a", "data[0]", *cookbook_datum("s:0"))
    b.resolve("alice", "sess-a", "data[0]", *cookbook_datum("s:1"))
    assert len(b) == 1


def test_a_tenant_over_its_budget_evicts_only_its_own_oldest():
    size = book().nbytes  # one record
    b = StabilityRecords(tenant_bytes=3 * size, max_bytes=100 * size, clock=Clock())
    b.put("bob", "sess-b", ["b:0"], PROMPT, [SAMPLED])
    b.put("alice", "sess-a", [f"s:{i}" for i in range(5)], PROMPT, [SAMPLED] * 5)
    assert len(b) == 4  # alice keeps her 3 newest, bob keeps his
    b.resolve("bob", "sess-b", "data[0]", *cookbook_datum("b:0"))
    for i in (2, 3, 4):
        b.resolve("alice", "sess-a", "data[0]", *cookbook_datum(f"s:{i}"))
    with pytest.raises(EngineInputError, match="no recorded sequence 's:1'"):
        b.resolve("alice", "sess-a", "data[0]", *cookbook_datum("s:1"))


def test_the_whole_book_keeps_within_its_budget_least_recently_used_first():
    size = book().nbytes
    b = StabilityRecords(tenant_bytes=10 * size, max_bytes=2 * size, clock=Clock())
    b.put("alice", "sess-a", ["s:0"], PROMPT, [SAMPLED])
    b.put("bob", "sess-b", ["b:0"], PROMPT, [SAMPLED])
    b.resolve("alice", "sess-a", "data[0]", *cookbook_datum("s:0"))  # alice's is now newer
    b.put("carol", "sess-c", ["c:0"], PROMPT, [SAMPLED])
    assert len(b) == 2 and b.nbytes <= 2 * size
    b.resolve("alice", "sess-a", "data[0]", *cookbook_datum("s:0"))
    with pytest.raises(EngineInputError, match="no recorded sequence 'b:0'"):
        b.resolve("bob", "sess-b", "data[0]", *cookbook_datum("b:0"))
