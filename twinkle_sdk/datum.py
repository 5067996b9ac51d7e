"""Convert an encoded row into a Tinker `Datum` for `training_client.forward_backward`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twinkle_sdk.template import IGNORE_INDEX


def input_feature_to_datum(feature: Mapping[str, Any]) -> Any:
    """An encoded row (`input_ids`, `labels`) as a `tinker.types.Datum` for cross entropy.

    Next-token form: the model reads input_ids[:-1] and is scored on target_tokens =
    input_ids[1:] with weight 1.0 where labels[1:] is a trained token (not -100), else 0.0.
    A row without labels trains on every token.
    """
    # Lazy: tinker is only needed by scripts that talk to a Tinker endpoint.
    from tinker import types

    input_ids = [int(t) for t in feature["input_ids"]]
    if len(input_ids) < 2:
        raise ValueError(f"a datum needs at least 2 tokens, the row has {len(input_ids)}")
    labels = feature.get("labels")
    if labels is None:
        labels = input_ids
    labels = [int(t) for t in labels]
    if len(labels) != len(input_ids):
        raise ValueError(f"labels has {len(labels)} entries, input_ids {len(input_ids)}")
    n = len(input_ids) - 1
    weights = [0.0 if label == IGNORE_INDEX else 1.0 for label in labels[1:]]
    return types.Datum(
        model_input=types.ModelInput.from_ints(input_ids[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=input_ids[1:], dtype="int64", shape=[n]),
            "weights": types.TensorData(data=weights, dtype="float32", shape=[n]),
        },
    )
