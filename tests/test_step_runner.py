"""The worker's StepRunner (workers/runner.py), driven in this process as a worker drives it."""

from __future__ import annotations

import torch
from cp_scenario import frames
from helpers import ce_request, make_engine

from twinkled.protocol.frames import StepF
from twinkled.protocol.types import LoraConfig
from twinkled.workers.runner import StepRunner


def test_an_adapter_missing_on_the_worker_is_a_server_fault_and_fails_only_its_op(tiny_dir):
    """The daemon sends only ops of adapters it brought in: one missing on the worker means
    the two disagree (a daemon bug, as the tiers' spill race was). Its client is told to
    submit again (category server), not blamed; the step's other ops train."""
    engine = make_engine(tiny_dir)
    engine.add_adapter("here", LoraConfig(rank=4, seed=1))
    gen, vocab = torch.Generator().manual_seed(0), engine.model.vocab_size
    step = StepF(1, "train", frames([ce_request("gone", gen, vocab, [5]),
                                     ce_request("here", gen, vocab, [6])]))
    missing, trained = StepRunner(engine, 0, 1, None).run(step)
    assert missing.category == "server" and "'gone'" in missing.error
    assert "submit the request again" in missing.error
    assert trained.error is None
