"""twinkle_sdk's model layer in local mode, and its RL pieces."""

from __future__ import annotations

import math

import pytest
import torch

import twinkle_sdk as twinkle
from twinkle_sdk import (
    CompletionRewardMetric,
    GRPOAdvantage,
    GSM8KAccuracyReward,
    GSM8KFormatReward,
    RLOOAdvantage,
    TransformersModel,
)
from twinkle_sdk.schedules import make_schedule


def _rows(tok, texts):
    out = []
    for q, a in texts:
        prompt = tok(q).input_ids
        answer = tok(a).input_ids
        out.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return out


TEXTS = [("who are you?", " I am twinkle."), ("hello", " hi there friend"),
         ("one two", " three four five"), ("the sun", " is big and hot")]


def _model(tiny_dir, accum=1):
    twinkle.initialize(mode="local")
    m = TransformersModel(model_id=str(tiny_dir))
    m.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8}, gradient_accumulation_steps=accum)
    m.set_optimizer("AdamW", lr=1e-2)
    return m


def test_gradient_accumulation_of_halves_equals_the_whole_batch(tiny_dir):
    # Four rows with 3 loss tokens each: the mean of the halves' means is the whole's mean.
    rows = [{"input_ids": [9 + i, 40 + i, 70 + i, 100 + i, 130 + i, 160 + i],
             "labels": [-100, -100, -100, 100 + i, 130 + i, 160 + i]} for i in range(4)]
    whole = _model(tiny_dir)
    whole.forward_backward(inputs=rows)
    whole.clip_grad_and_step()
    halves = _model(tiny_dir, accum=2)
    halves.forward_backward(inputs=rows[:2])
    halves.clip_grad_and_step()
    assert halves.steps == 0  # accumulating: no optimizer step yet
    halves.forward_backward(inputs=rows[2:])
    halves.clip_grad_and_step()
    assert halves.steps == 1
    after = whole.forward_only(inputs=rows)["loss"]
    assert halves.forward_only(inputs=rows)["loss"] == pytest.approx(after, rel=1e-5)
    untrained = _model(tiny_dir).forward_only(inputs=rows)["loss"]
    assert after < untrained  # the step did something
    metric = halves.calculate_metric(is_training=True)
    assert metric["steps"] == 1 and metric["lr"] == pytest.approx(1e-2)


def test_loss_is_the_mean_token_loss_and_packed_rows_count_alike(tiny_dir):
    m = _model(tiny_dir)
    rows = _rows(m.backend.tokenizer, TEXTS[:2])
    out = m.forward_only(inputs=rows)
    outputs, _ = m.backend.forward_backward(
        [{"tokens": r["input_ids"][:-1], "target_tokens": r["input_ids"][1:]} for r in rows],
        "cross_entropy", {}, True)
    nll = [-lp for o, r in zip(outputs, rows, strict=True)
           for lp, label in zip(o["logprobs"], r["labels"][1:], strict=True) if label != -100]
    assert out["loss"] == pytest.approx(sum(nll) / len(nll), rel=1e-6)
    packed = {"input_ids": rows[0]["input_ids"] + rows[1]["input_ids"],
              "labels": rows[0]["labels"] + rows[1]["labels"],
              "position_ids": list(range(len(rows[0]["input_ids"])))
              + list(range(len(rows[1]["input_ids"])))}
    assert m.forward_only(inputs=[packed])["loss"] == pytest.approx(out["loss"], rel=1e-6)


def test_configuration_errors_name_the_choices(tiny_dir):
    m = _model(tiny_dir)
    with pytest.raises(ValueError, match="AdamW"):
        m.set_optimizer("SGD", lr=0.1)
    with pytest.raises(ValueError, match="CosineWarmupScheduler"):
        m.set_lr_scheduler("Exponential")
    with pytest.raises(ValueError, match="lm_head"):
        twinkle.model.lora_targets(["conv1"])
    with pytest.raises(NotImplementedError, match="data parallelism"):
        twinkle.DeviceMesh.from_sizes(fsdp_size=2)
    with pytest.raises(ValueError, match="init_twinkle_client"):
        twinkle.initialize(mode="ray")
    with pytest.raises(ValueError, match="encode the dataset"):
        m.forward_backward(inputs=[{"messages": []}])
    m.set_loss("GRPOLoss", epsilon=0.2)
    assert m.loss_fn == "ppo"
    assert m.loss_config == pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    with pytest.raises(ValueError, match="needs old_logps"):
        m.forward_backward(inputs=_rows(m.backend.tokenizer, TEXTS[:1]))


def test_lr_schedules_follow_torch_and_transformers():
    warm = make_schedule("CosineWarmupScheduler", 1.0, num_warmup_steps=4, num_training_steps=12)
    lrs = []
    for _ in range(12):
        lrs.append(warm.lr)
        warm.step()
    assert lrs[:4] == pytest.approx([0.0, 0.25, 0.5, 0.75])
    assert lrs[4] == pytest.approx(1.0) and lrs[8] == pytest.approx(0.5)
    lin = make_schedule("LinearLR", 2.0, start_factor=0.5, total_iters=2)
    seen = [lin.lr, (lin.step(), lin.lr)[1], (lin.step(), lin.lr)[1]]
    assert seen == pytest.approx([1.0, 1.5, 2.0])
    cos = make_schedule("CosineAnnealingLR", 1.0, T_max=2, eta_min=0.0)
    cos.step()
    assert cos.lr == pytest.approx(0.5)


def test_grpo_and_rloo_advantages_group_prompts_times_generations():
    # Two prompts, three generations, laid out as prompts * 3: [p0, p1, p0, p1, p0, p1].
    rewards = [1.0, 10.0, 2.0, 10.0, 3.0, 13.0]
    adv = GRPOAdvantage()(rewards, num_generations=3, scale="none")
    assert adv.tolist() == pytest.approx([-1.0, -1.0, 0.0, -1.0, 1.0, 2.0])
    scaled = GRPOAdvantage()(rewards, num_generations=3)
    std0 = torch.tensor([1.0, 2.0, 3.0]).std(unbiased=False).item()
    assert scaled[0].item() == pytest.approx(-1.0 / (std0 + 1e-4))
    rloo = RLOOAdvantage()(rewards, num_generations=3)
    assert rloo[0].item() == pytest.approx(1.0 - 2.5)
    with pytest.raises(ValueError, match="groups of 4"):
        GRPOAdvantage()(rewards, num_generations=4)


def test_gsm8k_rewards_and_the_reward_metric():
    def t(text, truth="42"):
        return {"messages": [{"role": "user", "content": "q"},
                             {"role": "assistant", "content": text}], "ground_truth": truth}

    trajectories = [t("so 6*7 = 42\n#### 42"), t("#### 41"), t("it is 42"), t("#### 1,200", "1200")]
    assert GSM8KAccuracyReward()(trajectories) == [1.0, 0.0, 0.0, 1.0]
    assert GSM8KFormatReward()(trajectories) == [1.0, 1.0, 0.0, 1.0]
    metric = CompletionRewardMetric()
    metric.accumulate(completion_lengths=[4, 6], rewards={"acc": [1.0, 0.0]})
    got = metric.calculate()
    assert got == {"reward/acc": 0.5, "completion_length": 5.0}
    metric.reset()
    assert metric.calculate() == {}
    assert not math.isnan(got["reward/acc"])
