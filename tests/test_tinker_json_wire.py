"""tinker_shim.json_wire: the JSON wire of tinker SDKs <= 0.24, beside the protobuf one.

Request bodies are dumped by the SDK's own Pydantic mirrors of the legacy JSON types (the
ones 0.24 posted; 0.38 keeps them), so they are the SDK's shape, not a hand-written guess;
results are checked against the SDK's own reading of the same protobuf payload. The real old
SDKs run end to end in tests/test_tinker_versions.py.
"""

from __future__ import annotations

import json
import math

import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_proto_response
from tinker.types._pydantic_types.datum import Datum as JsonDatum
from tinker.types._pydantic_types.forward_backward_input import ForwardBackwardInput
from tinker.types._pydantic_types.model_input import ModelInput as JsonModelInput
from tinker.types._pydantic_types.tensor_data import TensorData as JsonTensor

from tinker_shim.codec import (
    CodecError,
    TensorIn,
    decode_forward_backward,
)
from tinker_shim.json_wire import decode_json_forward, json_result, wants_json
from tinker_shim.output_codec import encode_forward_backward_output
from tinker_shim.sample_codec import SampledOut, encode_sample_response

TOKENS = [5, 17, 42, 99]
TARGETS = [17, 42, 99, 7]


def json_body(data: list[JsonDatum], loss_fn: str = "cross_entropy", config=None, *,
              key: str = "forward_backward_input", seq_id: int | None = 3) -> bytes:
    """What SDK <= 0.24 posts: its request model dumped as JSON, None fields left out."""
    fwd = ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config)
    body = {key: fwd.model_dump(mode="json", exclude_none=True), "model_id": "s:train:0"}
    if seq_id is not None:
        body["seq_id"] = seq_id
    return json.dumps(body).encode()


def proto_body(data: list[types.Datum], loss_fn: str = "cross_entropy", config=None) -> bytes:
    fwd = types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config)
    req = types.ForwardBackwardRequest(forward_backward_input=fwd, model_id="s:train:0",
                                       seq_id=3)
    return forward_backward_request_to_proto(req).SerializeToString()


def test_json_and_protobuf_bodies_decode_to_the_same_call() -> None:
    inputs = {"target_tokens": TARGETS, "weights": [1.0, 0.5, 0.0, 2.0],
              "logprobs": [-1.0, -2.0, -0.5, -0.25], "advantages": [1, 0, -1, 2]}
    config = {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    via_json = decode_json_forward(
        json_body([JsonDatum(model_input=JsonModelInput.from_ints(TOKENS),
                             loss_fn_inputs=inputs)], "ppo", config), forward_only=False)
    via_proto = decode_forward_backward(proto_body(
        [types.Datum(model_input=types.ModelInput.from_ints(TOKENS), loss_fn_inputs=inputs)],
        "ppo", config))
    assert via_json == via_proto
    assert via_json.data[0].loss_fn_inputs["advantages"].values == [1.0, 0.0, -1.0, 2.0]
    forward = decode_json_forward(json_body(
        [JsonDatum(model_input=JsonModelInput.from_ints(TOKENS),
                   loss_fn_inputs={"target_tokens": TARGETS})], key="forward_input"),
        forward_only=True)
    assert forward.forward_only and forward.seq_id == 3


def test_sparse_and_shapeless_json_tensors() -> None:
    # Top-K targets [4, 2], sparse CSR as from_torch_sparse sends them: cells not listed are 0.
    sparse = JsonTensor(data=[17, 3, 42, 99, 7], dtype="int64", shape=[4, 2],
                        sparse_crow_indices=[0, 2, 3, 4, 5], sparse_col_indices=[0, 1, 0, 0, 1])
    shapeless = JsonTensor(data=[1.0, 1.0, 1.0, 1.0], dtype="float32")
    call = decode_json_forward(json_body([JsonDatum(
        model_input=JsonModelInput.from_ints(TOKENS),
        loss_fn_inputs={"target_tokens": sparse, "weights": shapeless})]), forward_only=False)
    inputs = call.data[0].loss_fn_inputs
    assert inputs["target_tokens"] == TensorIn("int64", [4, 2], [17, 3, 42, 0, 99, 0, 0, 7])
    assert inputs["weights"].shape == [4]


def _datum(**inputs) -> dict:
    inputs.setdefault("target_tokens", {"data": TARGETS, "dtype": "int64"})
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]},
            "loss_fn_inputs": inputs}


def _raw(*data, loss_fn="cross_entropy", **extra) -> bytes:
    body = {"forward_backward_input": {"data": list(data), "loss_fn": loss_fn},
            "model_id": "s:train:0", "seq_id": 7}
    body.update(extra)
    return json.dumps(body).encode()


@pytest.mark.parametrize(("body", "message"), [
    (_raw(_datum(target_tokens={"data": [1.5, 2, 3, 4], "dtype": "int64"})),
     "data[0].loss_fn_inputs['target_tokens']: an int64 tensor holds non-integer values"),
    (_raw(_datum(weights={"data": [1.0, 1.0], "dtype": "float32", "shape": [4]})),
     "shape [4] does not match 2 values"),
    (_raw(_datum(weights={"data": [1.0], "dtype": "float32", "shape": [2, 1],
                          "sparse_crow_indices": [0, 1, 1]})), "a sparse tensor needs"),
    (_raw(_datum(target_tokens={"data": [1], "dtype": "int64", "shape": [2, 2],
                                "sparse_crow_indices": [0, 1, 5], "sparse_col_indices": [0]})),
     "inconsistent sparse_csr indices"),
    (_raw(_datum(weights={"data": [1.0], "dtype": "float32", "shape": [4096, 4096]})),
     "elements"),
    (_raw(_datum(weights={"data": [1e39, 0, 0, 0], "dtype": "float32"})),
     "data[0].loss_fn_inputs['weights']: a value is out of the float32 range"),
    (_raw(_datum(target_tokens={"data": [2**64, 0, 0, 0], "dtype": "int64"})),
     "data[0].loss_fn_inputs['target_tokens']: a value is out of the int64 range"),
    (_raw(_datum(weights={"data": [1, 1, 1, 1], "dtype": "bfloat16"})),
     "Invalid enum value 'bfloat16'"),
    (_raw({"model_input": {"chunks": [{"type": "image", "data": "AA==", "format": "png"}]},
           "loss_fn_inputs": {}}), "data[0].model_input: image chunks come through the protobuf wire"),
    (_raw({"model_input": {"chunks": [{"tokens": [-1]}]}, "loss_fn_inputs": {}}),
     "$.forward_backward_input.data[0].model_input.chunks[0].tokens[0]"),
    (_raw(_datum(), loss_fn="custom"), "custom losses run on the client"),
    (_raw(), "needs at least one datum"),
    (_raw(_datum(), loss_fn_config=None, seq_id="7"), "$.seq_id"),
])
def test_bad_json_bodies_are_refused_naming_the_field(body: bytes, message: str) -> None:
    with pytest.raises(CodecError) as e:
        decode_json_forward(body, forward_only=False)
    assert message in str(e.value)
    if b'"seq_id": 7' in body:  # the envelope was read: the refusal can take its seq_id
        assert (e.value.model_id, e.value.seq_id) == ("s:train:0", 7)


def test_unreadable_json_is_refused_without_ids() -> None:
    for body in (b"\x08\x01garbage", b'{"model_id": "s:train:0"', b"[]"):
        with pytest.raises(CodecError, match="request body") as e:
            decode_json_forward(body, forward_only=False)
        assert e.value.model_id is None
    with pytest.raises(CodecError, match="forward_input"):  # /forward takes its own body
        decode_json_forward(_raw(_datum()), forward_only=True)


def test_forward_backward_result_as_json_is_what_the_sdk_reads_from_protobuf() -> None:
    outputs = [{"logprobs": ([-0.5, -1.25, -2.0], "float32"),
                "topk": TensorIn("int64", [3, 2], [1, 2, 3, 4, 5, 6])},
               {"logprobs": ([-0.75], "float32"), "topk": TensorIn("int64", [1, 2], [7, 8])},
               {"logprobs": ([-3.0, -4.0], "float32"),
                "topk": TensorIn("int64", [2, 1], [9, 10])}]  # another trailing shape
    payload = encode_forward_backward_output(outputs, {"loss:sum": 2.5})
    got = json.loads(json_result("forward_backward", payload))
    sdk = deserialize_proto_response(payload, types.ForwardBackwardOutput)
    assert got["metrics"] == {"loss:sum": 2.5}
    assert got["loss_fn_output_type"] == sdk.loss_fn_output_type
    assert len(got["loss_fn_outputs"]) == 3
    for mine, theirs in zip(got["loss_fn_outputs"], sdk.loss_fn_outputs, strict=True):
        for name, tensor in theirs.items():
            assert mine[name]["dtype"] == tensor.dtype
            assert mine[name]["shape"] == list(tensor.to_numpy().shape)
            assert mine[name]["data"] == tensor.to_numpy().reshape(-1).tolist()


def test_sample_result_as_json() -> None:
    seqs = [SampledOut([11, 12], [-0.5, -0.25], "length"), SampledOut([13], None, "stop")]
    topk = ([[], [4, 5], [6]], [[], [-0.1, -0.2], [-0.3]])
    payload = encode_sample_response(seqs, [None, -1.5, -2.5], topk_prompt=topk,
                                     prompt_cache_hit_tokens=2)
    got = json.loads(json_result("sample", payload))
    assert got["sequences"] == [
        {"stop_reason": "length", "tokens": [11, 12], "logprobs": [-0.5, -0.25]},
        {"stop_reason": "stop", "tokens": [13], "logprobs": None}]
    assert got["prompt_logprobs"] == [None, -1.5, -2.5]
    ids_lps = [[(i, lp) for i, lp in row] if row else None
               for row in got["topk_prompt_logprobs"]]
    assert ids_lps[0] is None and ids_lps[2][0][0] == 6 and len(ids_lps[1]) == 2
    assert math.isclose(ids_lps[1][1][1], -0.2, rel_tol=1e-6)
    assert got["prompt_cache_hit_tokens"] == 2 and got["type"] == "sample"
    assert json_result("optim_step", b"{}") is None  # already JSON: nothing to do


@pytest.mark.parametrize(("accept", "json_wanted"), [
    ("application/json", True),  # 0.16.1 (and 0.17)
    (None, False), ("*/*", False),  # a raw HTTP client: what today's SDK reads
    ("application/x-protobuf, application/json", False),  # 0.18 .. 0.24
    ("application/x-protobuf", False),  # 0.25 .. 0.38
])
def test_a_result_is_json_only_for_a_poll_that_asks_for_json_alone(accept, json_wanted):
    assert wants_json(accept) is json_wanted


ODD = [None, True, -1, 0, 2**63, 2**64, -(2**70), 1.5, -1e300, "x", "", [], [1, "a"], {},
       {"data": []}, [[1, 2], [3]], "encoded_text", "image", 1e39, [2**31]]


def _mutants(body: dict, rng, n: int):
    """`n` copies of `body`, each with one value replaced by an odd one or one key dropped."""
    def paths(node, at=()):
        yield at
        children = node.items() if isinstance(node, dict) else (
            enumerate(node) if isinstance(node, list) else ())
        for key, child in children:
            yield from paths(child, (*at, key))

    every = list(paths(body))[1:]
    for _ in range(n):
        copy = json.loads(json.dumps(body))
        *parent_path, key = rng.choice(every)
        parent = copy
        for k in parent_path:
            parent = parent[k]
        if isinstance(parent, dict) and rng.random() < 0.25:
            del parent[key]
        else:
            parent[key] = rng.choice(ODD)
        yield json.dumps(copy).encode()


def test_any_mutation_of_a_json_body_is_a_codec_error_or_a_call() -> None:
    """What the route turns into a 400 (CodecError) or runs: never another exception (a
    500), whatever a field holds."""
    import random

    sparse = {"data": [17, 3], "dtype": "int64", "shape": [2, 2],
              "sparse_crow_indices": [0, 1, 2], "sparse_col_indices": [0, 1]}
    valid = json.loads(_raw(_datum(weights={"data": [1.0, 1.0], "dtype": "float32",
                                            "shape": [2]}, advantages=sparse),
                            loss_fn_config={"clip_low_threshold": 0.8}))
    rng = random.Random(0)
    for body in _mutants(valid, rng, 600):
        try:
            decode_json_forward(body, forward_only=False)
        except CodecError:
            pass
