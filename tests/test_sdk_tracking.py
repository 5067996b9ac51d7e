"""twinkle_sdk's training curves: calculate_metric's means logged to TensorBoard (read back
from the event files) and a JSON-lines file when asked, and nowhere by default."""

from __future__ import annotations

import importlib.util
import json
import struct

import pytest

import twinkle_sdk as twinkle
from twinkle_sdk import MetricsLogger, TransformersModel

ROWS = [{"input_ids": [9 + i, 40 + i, 70 + i, 100 + i], "labels": [-100, -100, 70 + i, 100 + i]}
        for i in range(2)]


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the TensorBoard event files under `log_dir` (TFRecord framing:
    length, its CRC, the Event protobuf, its CRC)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_metrics_go_to_tensorboard_and_jsonl_when_asked(tiny_dir, tmp_path):
    pytest.importorskip("tensorboardX")
    twinkle.initialize(mode="local")
    model = TransformersModel(model_id=str(tiny_dir), report_to=["tensorboard", "jsonl"],
                              logging_dir=str(tmp_path))
    model.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8})
    model.set_optimizer("AdamW", lr=1e-2)
    seen = []
    for _ in range(2):
        model.forward_backward(inputs=ROWS)
        model.clip_grad_and_step()
        seen.append(model.calculate_metric(is_training=True))
    model.forward_only(inputs=ROWS)
    evaluated = model.calculate_metric(is_training=False)
    model.logger.close()

    got = scalars(tmp_path)
    assert [s for s, _ in got["train/loss"]] == [1, 2]
    assert [v for _, v in got["train/loss"]] == pytest.approx([m["loss"] for m in seen])
    assert [v for _, v in got["train/lr"]] == pytest.approx([1e-2, 1e-2])
    assert got["eval/loss"] == [(2, pytest.approx(evaluated["loss"]))]
    lines = [json.loads(x) for x in next(tmp_path.rglob("metrics.jsonl")).read_text().splitlines()]
    assert [(x["step"], x.get("train/loss", x.get("eval/loss"))) for x in lines] == [
        (1, pytest.approx(seen[0]["loss"])), (2, pytest.approx(seen[1]["loss"])),
        (2, pytest.approx(evaluated["loss"]))]
    assert model.logger.records[0] == (1, {k: pytest.approx(v) for k, v in lines[0].items()
                                           if k.startswith("train/")})


def test_nothing_is_logged_by_default_and_unknown_sinks_are_named(tiny_dir, tmp_path):
    twinkle.initialize(mode="local")
    assert TransformersModel(model_id=str(tiny_dir)).logger is None
    with pytest.raises(ValueError, match=r"report_to: unknown \['mlflow'\]"):
        MetricsLogger("mlflow", tmp_path)
    if importlib.util.find_spec("wandb") is None:  # asked for and absent: says what to install
        with pytest.raises(ImportError, match="pip install wandb"):
            MetricsLogger("wandb", tmp_path)
    assert not list(tmp_path.rglob("*.*"))
