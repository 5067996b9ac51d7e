"""tinker-cookbook 0.6.1's supervised loop (`tinker_cookbook.supervised.train.main`),
unmodified, against a real `twinkled serve` on a tiny model with local text, offline: the
training NLL falls, and the loop's final checkpoint is a training state it can resume from.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

cookbook = pytest.importorskip("tinker_cookbook")
tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
os.environ.setdefault("TINKER_TELEMETRY", "0")

EPOCHS = 6


def test_cookbook_sl_loop_lowers_the_loss_and_saves_a_resumable_state(daemon, tiny_dir,
                                                                     tmp_path, monkeypatch):
    from cookbook_sl_data import Lines, LinesBuilder
    from tinker_cookbook import tokenizer_utils
    from tinker_cookbook.supervised import train
    from transformers import AutoTokenizer

    monkeypatch.setenv("TINKER_API_KEY", daemon.keys["alice"])
    name = tiny_dir.name  # the daemon serves the tiny model under its directory's name
    tokenizer_utils.register_tokenizer(name, lambda: AutoTokenizer.from_pretrained(tiny_dir))
    config = train.Config(
        log_path=str(tmp_path / "run"), model_name=name, recipe_name="twinkle_sl",
        dataset_builder=LinesBuilder(model_name=name), learning_rate=1e-2,
        lr_schedule="constant", num_epochs=EPOCHS, lora_rank=8, base_url=daemon.url,
        save_every=0, eval_every=0, infrequent_eval_every=0)
    asyncio.run(train.main(config))

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == EPOCHS and nll[-1] < 0.6 * nll[0], nll
    saved = [json.loads(line) for line in (tmp_path / "run" / "checkpoints.jsonl").open()]
    state = saved[-1]["state_path"]
    assert state.startswith("tinker://") and "/weights/" in state
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    resumed = sc.create_training_client_from_state_with_optimizer(state).result(timeout=120)
    fwd = resumed.forward(Lines(name).data, "cross_entropy").result(timeout=120)
    tokens = sum(len(o["logprobs"].tolist()) for o in fwd.loss_fn_outputs)
    assert fwd.metrics["loss:sum"] / tokens < 0.6 * nll[0]  # the trained weights came back
