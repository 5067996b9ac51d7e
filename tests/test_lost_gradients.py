"""Which optim_step fails with a forward_backward that failed after it was queued
(twinkled/core/lost_gradients.py): the model's next one, once, however late it arrives;
not one behind a redo of the forward_backward, nor once one was answered in the same step."""

from __future__ import annotations

from twinkled.core.lost_gradients import LostGradients


def test_the_optim_step_queued_behind_fails_once_with_the_same_category():
    lost = LostGradients()
    lost.failed("m", 5, last_queued=6, why="worker lost", category="server")
    message, category = lost.check("m", 6)
    assert category == "server" and "seq_id 5" in message and "worker lost" in message
    assert lost.check("m", 6) is None  # once
    assert lost.check("other", 6) is None


def test_an_optim_step_that_arrives_after_the_failure_still_fails():
    # The pipelined optim_step's request reached the daemon only after the forward_backward
    # failed (nothing was queued behind it then): it was sent blind all the same.
    lost = LostGradients()
    lost.failed("m", 5, last_queued=5, why="worker lost", category="server")
    assert lost.check("m", 6)[1] == "server"


def test_an_optim_step_behind_a_redone_forward_backward_runs():
    lost = LostGradients()
    lost.failed("m", 5, last_queued=5, why="x", category="server")  # nothing queued behind
    lost.trained("m", 6)  # the client heard, and redid the forward_backward
    assert lost.check("m", 7) is None


def test_a_blind_forward_backward_queued_behind_the_failure_does_not_clear_it():
    lost = LostGradients()
    lost.failed("m", 5, last_queued=7, why="x", category="server")
    lost.trained("m", 6)  # accumulated on top of the lost one: its gradients are still gone
    assert lost.check("m", 7) is not None


def test_an_optim_step_answered_in_the_same_step_settles_the_failure():
    lost = LostGradients()
    lost.failed("m", 5, last_queued=9, why="x", category="server")
    lost.settled("m", 6)  # failed with the forward_backward, in its step
    assert lost.check("m", 8) is None  # a later pair sent blind trains on what it sent


def test_a_second_failure_sent_blind_keeps_the_first():
    lost = LostGradients()
    lost.failed("m", 5, last_queued=7, why="first", category="user")
    lost.failed("m", 6, last_queued=8, why="second", category="server")
    message, category = lost.check("m", 8)
    assert "seq_id 5" in message and category == "user"
