"""Long-context runs on lanes apart from short ones (twinkled/core/long_rows.py): the
placement rules of `Lanes.choose` and of the balancer (core/balance.py), on lanes that hold
models in name only (no workers: the rules read the lanes' counts and what is idle). The
real daemon with two lanes: tests/test_long_lane_daemon.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from twinkled.core.balance import balance
from twinkled.core.lanes import Lanes
from twinkled.core.long_rows import LongRuns
from twinkled.protocol.types import LoraConfig

THRESHOLD = 100


class _Residency:
    """A lane's adapters: model -> busy (queued or in flight)."""

    def __init__(self) -> None:
        self.models: dict[str, bool] = {}
        self.room = SimpleNamespace(fits=lambda _config: True, used=lambda: 0)

    def is_open(self, model: str) -> bool:
        return model in self.models

    def count(self) -> int:
        return len(self.models)

    def movable(self) -> list[str]:
        return [m for m, busy in self.models.items() if not busy]

    def keeps(self, _model: str) -> bool:
        return False

    async def send_away(self, model: str) -> bool:
        if self.models.get(model) is not False:
            return False
        del self.models[model]
        return True

    async def ensure_loaded(self, run: dict) -> None:
        self.models[run["id"]] = False


def _lane(index: int) -> SimpleNamespace:
    residency = _Residency()
    return SimpleNamespace(index=index, down="", residency=residency,
                           planner=SimpleNamespace(queues=SimpleNamespace(count=residency.count)),
                           executor=SimpleNamespace(journal=SimpleNamespace(
                               release=lambda _model: None)))


def _lanes(n: int, threshold: int = THRESHOLD, **on: list[str]) -> Lanes:
    """`n` lanes; `on`: lane -> its models ("l..." long, "s..." short; "*" busy), e.g.
    lane0=["l1", "s1*"]."""
    store = SimpleNamespace(runs=SimpleNamespace(get=lambda model: {"id": model}))
    lanes = Lanes([_lane(i) for i in range(n)], store, long_row_tokens=threshold)
    for i in range(n):
        for name in on.get(f"lane{i}", []):
            model = name.rstrip("*")
            lanes.all[i].residency.models[model] = name.endswith("*")
            lanes.place(model, lanes.all[i])
            if model.startswith("l") and threshold:
                assert lanes.long.saw(model, "lena", THRESHOLD + 1)
    return lanes


def _where(lanes: Lanes) -> list[list[str]]:
    return [sorted(lane.residency.models) for lane in lanes.all]


def test_a_run_is_long_from_its_first_row_over_the_threshold():
    long = LongRuns(THRESHOLD)
    assert not long.saw("a", "t", THRESHOLD)  # as long as the threshold: not over it
    assert long.saw("a", "t", THRESHOLD + 1) and long.is_long("a")
    assert not long.saw("a", "t", 10 * THRESHOLD)  # once
    off = LongRuns(0)
    assert not off.saw("a", "t", 10**6) and not off.is_long("a")


def test_new_runs_go_to_a_lane_without_long_runs_and_long_runs_to_theirs():
    config = LoraConfig(rank=4)
    # lane 0 holds one long run, lane 1 two short ones: fewest models would be lane 0
    lanes = _lanes(2, lane0=["l1"], lane1=["s1", "s2"])
    assert lanes.choose(config).index == 1
    assert lanes.choose(config, "s9").index == 1
    # a long run brought back (after an idle unload): beside the other long run
    assert _lanes(2, lane0=["s3"], lane1=["l1", "s1", "s2"]).choose(config, "l1").index == 1
    # every lane holds a long run: the fewest models, as without long runs (never refused)
    assert _lanes(2, lane0=["l1", "s1"], lane1=["l2"]).choose(config).index == 1
    # one lane, or the rule off: as before
    assert _lanes(1, lane0=["l1"]).choose(config).index == 0
    assert _lanes(2, 0, lane0=["l1"], lane1=["s1", "s2"]).choose(config).index == 0


def test_balance_gathers_idle_long_runs_and_moves_idle_short_runs_off_their_lane():
    # lanes 0 and 1 hold a long run each (and one short run each): lane 0 becomes the long
    # lane (the lower index); l2 joins it, s4 is then alone on lane 1 and stays.
    lanes = _lanes(3, lane0=["l1", "s1*"], lane1=["l2", "s4"], lane2=["s2"])
    assert asyncio.run(balance(lanes)) == 1  # s1 has work queued: it stays for now
    assert _where(lanes) == [["l1", "l2", "s1"], ["s4"], ["s2"]]
    lanes.all[0].residency.models["s1"] = False  # s1's work done: it is idle now
    assert asyncio.run(balance(lanes)) == 1
    assert _where(lanes) == [["l1", "l2"], ["s1", "s4"], ["s2"]]
    assert lanes.long.status(lanes.all) == [{"lane": 0, "run": "l1", "tenant": "lena"},
                                            {"lane": 0, "run": "l2", "tenant": "lena"}]
    # the short lanes are evened out among themselves, the long lane left out of it
    lanes = _lanes(2, lane0=["l1", "s1", "s2", "s3"], lane1=["s4"])
    asyncio.run(balance(lanes))
    assert _where(lanes) == [["l1"], ["s1", "s2", "s3", "s4"]]


def test_with_no_short_runs_long_runs_spread_as_any_runs():
    lanes = _lanes(2, lane0=["l1", "l2", "l3"])
    assert asyncio.run(balance(lanes)) == 1
    assert [len(m) for m in _where(lanes)] == [2, 1]
    # and with one lane, or the rule off, balance is what it was
    lanes = _lanes(2, 0, lane0=["l1", "s1"], lane1=["s2"])
    assert asyncio.run(balance(lanes)) == 0 and lanes.long.status(lanes.all) == []
