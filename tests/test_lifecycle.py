"""The daemon's life cycle (twinkled/core/lifecycle.py): its states, the moves between
them, what healthz reports in each and what work each takes. Unit tests: a real service
is built (its lanes, futures, store) but never started, so no model loads; the moves are
made by hand, as start, drain and stop make them."""

from __future__ import annotations

import asyncio

import pytest

from twinkled.core.lifecycle import Draining, IllegalTransition
from twinkled.core.make_executor import in_process_executor
from twinkled.core.service import Service
from twinkled.protocol.config import Config
from twinkled.protocol.errors import UserError
from twinkled.store import Store


@pytest.fixture
def life(tmp_path):
    cfg = Config(data_dir=tmp_path, device="cpu")
    store = Store(tmp_path / "twinkled.store.db")
    yield Service(cfg, store, executor=[in_process_executor(cfg)]).life
    store.close()


def test_loading_takes_work_for_new_models_and_asks_restored_ones_to_retry(life):
    assert (life.state, life.health, life.serving) == ("loading", "loading", False)
    life.check_intake()  # a create is queued until the model is loaded
    with pytest.raises(Draining, match="starting"):
        life.check_loaded("sess-1:train:0")  # a run not restored yet: a 503 it retries
    life.check_loaded(None)  # (a base-model sample names no run)


def test_ready_pause_resume_and_stop(life):
    life.loaded()
    assert (life.state, life.health, life.serving) == ("ready", "ok", True)
    life.check_intake()
    life.check_loaded("sess-1:train:0")  # ready: an unknown run is the command's 400
    life.pause_intake()  # `twinkled ctl drain`
    assert (life.state, life.health, life.serving) == ("ready", "draining", False)
    with pytest.raises(Draining, match="draining"):
        life.check_intake()
    life.resume_intake()  # `twinkled ctl drain --undo`
    assert (life.health, life.serving) == ("ok", True)
    life.check_intake()
    life.begin_stop()  # SIGTERM
    assert (life.state, life.health, life.stopping, life.serving) == \
        ("draining", "draining", True, False)
    with pytest.raises(Draining):
        life.check_intake()
    life.resume_intake()  # undoing a ctl drain does not undo a stop
    with pytest.raises(Draining):
        life.check_intake()


@pytest.mark.parametrize("move", ["loaded", "failed", "begin_stop"])
def test_a_stop_is_never_undone(life, move):
    life.begin_stop()
    with pytest.raises(IllegalTransition, match="draining"):
        getattr(life, move)(*(["OSError: x"] if move == "failed" else []))
    assert life.state == "draining" and life.error is None


def test_a_failed_load_is_reported_and_refuses_work_as_the_user_s_error(life):
    life.failed("OSError: no config.json")
    assert (life.state, life.health, life.error) == ("failed", "failed", "OSError: no config.json")
    with pytest.raises(UserError, match="the model failed to load: OSError: no config.json"):
        life.check_intake()
    with pytest.raises(IllegalTransition):
        life.loaded()  # a failed daemon does not become ready
    life.begin_stop()
    assert life.state == "draining" and life.error == "OSError: no config.json"


def test_ready_is_reached_once(life):
    life.loaded()
    for move in (life.loaded, lambda: life.failed("late")):
        with pytest.raises(IllegalTransition):
            move()
    assert life.state == "ready" and life.error is None


def test_waiters_wake_when_loading_ends_and_when_polls_stop(life):
    async def go():
        settled = asyncio.create_task(life.settled())
        polls = asyncio.create_task(life.polls_stopped())
        await asyncio.sleep(0)
        assert not settled.done() and not polls.done()
        life.loaded()
        await asyncio.wait_for(settled, 5)
        assert not polls.done()
        life.stop_polls()
        await asyncio.wait_for(polls, 5)

    asyncio.run(go())


def test_drain_pauses_the_intake_and_undo_resumes_it(life):
    life.loaded()
    # Nothing is queued: drained at once, and the intake stays paused until undone.
    assert asyncio.run(life.drain(timeout=5)) == {"drained": True, "queued": 0}
    assert life.health == "draining"
    assert asyncio.run(life.drain(undo=True)) == {"drained": False, "queued": 0}
    assert life.health == "ok"
