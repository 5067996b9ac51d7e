"""Wire compatibility of tinker_shim.codec with the unmodified tinker==0.38.0 client.

Requests are built with the client's public types and serialized by the client's own resource
method (tinker.resources.training.AsyncTrainingResource.forward_backward, with the HTTP post
stubbed out), so the bytes are exactly what the SDK POSTs. Responses are parsed with the client's
own proto dispatch (tinker.proto.response_conv.deserialize_proto_response), then run through the
client-side post-processing it applies (metric reduction, sequence-id stamping).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import zstandard
from tinker import types
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.lib.public_interfaces.sampling_client import _attach_sequence_ids
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_proto_response
from tinker.resources.training import AsyncTrainingResource

from tinker_shim.codec import (
    CodecError,
    SpanIn,
    TensorIn,
    decode_forward_backward,
)
from tinker_shim.output_codec import encode_forward_backward_output
from tinker_shim.sample_codec import SampledOut, encode_sample_response

# ------------------------------------------------------------------ helpers


def client_post(
    data: list[types.Datum],
    loss_fn: str = "cross_entropy",
    loss_fn_config: dict | None = None,
    *,
    model_id: str = "sess:train:0",
    seq_id: int = 1,
    forward_only: bool = False,
    compress: bool = False,
) -> tuple[bytes, dict[str, str]]:
    """Run the SDK's own forward_backward resource method; return (body, headers) it posts."""
    captured: dict = {}

    async def fake_post(path, *, body, options, cast_to):
        assert path == "/api/v1/forward_backward"
        captured.update(body=body, headers=options["headers"])
        return types.shared.UntypedAPIFuture(request_id="r1")

    resource = AsyncTrainingResource.__new__(AsyncTrainingResource)
    resource._client = SimpleNamespace(
        _client_config=SimpleNamespace(proto_compress_fwdbwd=compress)
    )
    resource._post = fake_post
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config
        ),
        model_id=model_id,
        seq_id=seq_id,
    )
    asyncio.run(resource.forward_backward(request=request, forward_only=forward_only))
    return captured["body"], captured["headers"]


def sft_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [0.0] + [1.0] * (len(tokens) - 2),
        },
    )


def f32(xs) -> list[float]:
    """The exact float32 value of each x, as the wire carries it."""
    return np.asarray(xs, dtype=np.float32).tolist()


# ------------------------------------------------------------------ requests


@pytest.mark.parametrize("compress", [False, True])
def test_cross_entropy_roundtrip(compress: bool) -> None:
    seqs = [[5, 17, 99, 3, 151643], [7, 8], list(range(1000, 1300))]
    body, headers = client_post(
        [sft_datum(s) for s in seqs], model_id="abc:train:3", seq_id=42, compress=compress
    )
    assert headers["Content-Type"] == "application/x-protobuf"
    assert (headers.get("Content-Encoding") == "zstd") is compress
    call = decode_forward_backward(body, headers.get("Content-Encoding"))
    assert (call.model_id, call.seq_id, call.loss_fn) == ("abc:train:3", 42, "cross_entropy")
    assert call.forward_only is False and call.loss_fn_config is None
    assert len(call.data) == len(seqs)
    for seq, datum in zip(seqs, call.data, strict=True):
        n = len(seq) - 1
        assert datum.tokens == seq[:-1]
        tt, w = datum.loss_fn_inputs["target_tokens"], datum.loss_fn_inputs["weights"]
        assert (tt.dtype, tt.shape, tt.values) == ("int64", [n], seq[1:])
        assert (w.dtype, w.shape, w.values) == ("float32", [n], [0.0] + [1.0] * (n - 1))
        assert all(isinstance(v, int) for v in tt.values)


def test_zstd_detected_by_magic_without_header() -> None:
    body, _ = client_post([sft_datum([1, 2, 3])], compress=True)
    assert decode_forward_backward(body, None).data[0].tokens == [1, 2]


def test_forward_only_and_rl_inputs_with_config() -> None:
    rng = np.random.default_rng(0)
    n = 6
    adv, lps = rng.normal(size=n).astype(np.float32), -rng.random(n).astype(np.float32)
    datum = types.Datum(
        # several text chunks are concatenated in order
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[1, 2]), types.EncodedTextChunk(tokens=[3, 4])]
        ).append_int(2**31 - 1).append_int(0),
        loss_fn_inputs={
            "target_tokens": np.array([2, 3, 4, 5, 6, 7], dtype=np.int64),
            "advantages": adv,  # numpy float32 arrays, as RL code passes them
            "logprobs": lps.tolist(),
        },
    )
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    body, headers = client_post([datum], "ppo", config, seq_id=7, forward_only=True)
    call = decode_forward_backward(body, headers.get("Content-Encoding"))
    assert call.forward_only is True and call.loss_fn == "ppo" and call.seq_id == 7
    assert call.loss_fn_config == config
    d = call.data[0]
    assert d.tokens == [1, 2, 3, 4, 2**31 - 1, 0]
    assert d.loss_fn_inputs["target_tokens"].values == [2, 3, 4, 5, 6, 7]
    assert d.loss_fn_inputs["advantages"] == TensorIn("float32", [n], adv.tolist())
    assert d.loss_fn_inputs["logprobs"].values == f32(lps)


def test_provenance_spans_decoded() -> None:
    """What the cookbook's rl_loop attaches for stable_reinforce reaches us span by span."""
    prompt, sampled = [11, 12, 13], [21, 22, 23, 24]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + sampled[:-1]),
        loss_fn_inputs={"target_tokens": prompt[1:] + sampled,
                        "advantages": [0.0, 0.0] + [1.0] * 4},
    ).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="s:0", length=3),
                     types.SampledProvenanceSpan(sequence_id="s:0", length=3)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="s:0", offset=1, length=2),
                        types.SampledProvenanceSpan(sequence_id="s:0", length=4)],
    )
    body, headers = client_post([datum, sft_datum([1, 2, 3])], "stable_reinforce",
                                {"kl_coeff": 0.02})
    call = decode_forward_backward(body, headers.get("Content-Encoding"))
    d, plain = call.data
    assert call.loss_fn == "stable_reinforce" and call.loss_fn_config == {"kl_coeff": 0.02}
    assert d.model_input_spans == [SpanIn("prompt", "s:0", 0, 3), SpanIn("sampled", "s:0", 0, 3)]
    assert d.loss_fn_input_spans == [SpanIn("prompt", "s:0", 1, 2),
                                     SpanIn("sampled", "s:0", 0, 4)]
    assert plain.model_input_spans is None and plain.loss_fn_input_spans is None


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.ClearField("loss_fn_input_spans"), r"data\[0\]: provenance comes as a pair"),
    (lambda d: setattr(d.model_input_spans[0].prompt_tokens, "length", -1),
     r"data\[0\].model_input_spans\[0\]: offset 0 and length -1 must be in"),
    (lambda d: setattr(d.loss_fn_input_spans[0].sampled_tokens, "sequence_id", ""),
     r"loss_fn_input_spans\[0\].sequence_id: must have 1..256 characters"),
    (lambda d: d.model_input_spans.add(), r"model_input_spans\[1\]: empty or unrecognised"),
])
def test_malformed_provenance_refused(mutate, message) -> None:
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="stable_reinforce")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.array([1, 2], dtype="<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].dense = np.array([2, 3], dtype="<i8").tobytes()
    d.loss_fn_inputs["target_tokens"].dtype = pb.DTYPE_INT64
    d.loss_fn_inputs["target_tokens"].shape.append(2)
    d.model_input_spans.add().prompt_tokens.length = 2
    span = d.loss_fn_input_spans.add().sampled_tokens
    span.sequence_id, span.length = "s:0", 2
    d.model_input_spans[0].prompt_tokens.sequence_id = "s:0"
    mutate(d)
    with pytest.raises(CodecError, match=message):
        decode_forward_backward(msg.SerializeToString())


def test_reference_doc_vector() -> None:
    body = bytes.fromhex(
        "0a09733a747261696e3a3010011a540a0c0a0a0a080100000002000000121a0a0777656967687473120f0a08"
        "000000000000803f180122010212280a0d7461726765745f746f6b656e7312170a1002000000000000000300"
        "0000000000001802220102220d63726f73735f656e74726f7079"
    )
    call = decode_forward_backward(body, None)
    assert (call.model_id, call.seq_id, call.loss_fn) == ("s:train:0", 1, "cross_entropy")
    assert call.data[0].tokens == [1, 2]
    assert call.data[0].loss_fn_inputs["target_tokens"].values == [2, 3]
    assert call.data[0].loss_fn_inputs["weights"].values == [0.0, 1.0]


def test_sparse_csr_expanded_with_zero_pad() -> None:
    # What TensorData.from_torch_sparse produces for a 2-D [N, K] target (pad 0).
    dense = [[0, 5, 0], [0, 0, 0], [7, 0, 9]]
    weights = [[0.0, 1.5, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, -1.0]]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(
                data=[5, 7, 9], dtype="int64", shape=[3, 3],
                sparse_crow_indices=[0, 1, 1, 3], sparse_col_indices=[1, 0, 2],
            ),
            "weights": types.TensorData(
                data=[1.5, 2.0, -1.0], dtype="float32", shape=[3, 3],
                sparse_crow_indices=[0, 1, 1, 3], sparse_col_indices=[1, 0, 2],
            ),
        },
    )
    body, _ = client_post([datum])
    inputs = decode_forward_backward(body).data[0].loss_fn_inputs
    assert inputs["target_tokens"] == TensorIn("int64", [3, 3], sum(dense, []))
    assert inputs["weights"] == TensorIn("float32", [3, 3], sum(weights, []))


def test_torch_2d_inputs_via_datum() -> None:
    torch = pytest.importorskip("torch")
    target = torch.zeros(4, 8, dtype=torch.int64)
    target[0, 3], target[2, 1] = 11, 12
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": target, "weights": torch.ones(4, 8)},
    )
    body, _ = client_post([datum])
    inputs = decode_forward_backward(body).data[0].loss_fn_inputs
    assert inputs["target_tokens"] == TensorIn("int64", [4, 8], target.flatten().tolist())
    assert inputs["weights"] == TensorIn("float32", [4, 8], [1.0] * 32)


def test_tensor_without_shape_is_1d() -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"weights": types.TensorData(data=[0.5, 1.0], dtype="float32")},
    )
    body, _ = client_post([datum])
    assert decode_forward_backward(body).data[0].loss_fn_inputs["weights"].shape == [2]


# ------------------------------------------------------------------ refusals


def test_image_chunk_kept_with_its_place() -> None:
    """An image chunk is kept as sent (decoded and checked at the door, for the model)."""
    datum = types.Datum(
        model_input=types.ModelInput(chunks=[
            types.EncodedTextChunk(tokens=[1, 2]),
            types.ImageChunk(data=b"\x89PNG fake", format="png", expected_tokens=4),
        ]),
        loss_fn_inputs={"target_tokens": [1] * 6, "weights": [1.0] * 6},
    )
    body, _ = client_post([datum], compress=True)
    d = decode_forward_backward(body, "zstd").data[0]
    assert d.tokens == [1, 2]
    assert [(i.at, i.data, i.format, i.expected_tokens) for i in d.images] == [
        (2, b"\x89PNG fake", "png", 4)]


def test_dmel_chunk_refused() -> None:
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    msg.data.add().model_input.add().dmel.dmel = b"\x00\x01"
    with pytest.raises(CodecError, match="dmel"):
        decode_forward_backward(msg.SerializeToString())


def test_text_loss_config_refused() -> None:
    body, _ = client_post([sft_datum([1, 2, 3])], "cross_entropy", {"loss_id": "abc"})
    with pytest.raises(CodecError, match="loss_id"):
        decode_forward_backward(body)
    # A server-side custom loss is told where custom losses run.
    body, _ = client_post([sft_datum([1, 2, 3])], "custom", {"loss_id": "abc", "beta": 0.1})
    with pytest.raises(CodecError, match="run on the client.*forward_backward_custom"):
        decode_forward_backward(body)


def test_bfloat16_refused_naming_field() -> None:
    msg = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[sft_datum([1, 2, 3])], loss_fn="cross_entropy"),
        model_id="m", seq_id=1,
    ))
    msg.data[0].loss_fn_inputs["weights"].dtype = pb.DTYPE_BFLOAT16
    with pytest.raises(CodecError, match=r"weights.*bfloat16"):
        decode_forward_backward(msg.SerializeToString())
    msg.data[0].loss_fn_inputs["weights"].dtype = pb.DTYPE_UNSPECIFIED
    with pytest.raises(CodecError, match=r"weights.*dtype"):
        decode_forward_backward(msg.SerializeToString())


@pytest.mark.parametrize(
    ("body", "encoding", "message"),
    [
        (pb.ForwardBackwardRequest(model_id="m", seq_id=1).SerializeToString(), None, "at least one datum"),
        (b"\xff\xff\xff", None, "malformed"),
        (b"\x28\xb5\x2f\xfdjunk", None, "zstd"),
        (b"", "gzip", "Content-Encoding"),
    ],
)
def test_structural_errors(body: bytes, encoding: str | None, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode_forward_backward(body, encoding)


def test_shape_mismatch_and_bad_csr() -> None:
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    tensor = msg.data.add().loss_fn_inputs["weights"]
    tensor.dtype, tensor.dense = pb.DTYPE_FLOAT32, np.zeros(3, np.float32).tobytes()
    tensor.shape.append(4)
    with pytest.raises(CodecError, match="shape"):
        decode_forward_backward(msg.SerializeToString())
    tensor.sparse_csr.values = np.zeros(1, np.float32).tobytes()
    tensor.sparse_csr.crow_indices = np.array([0, 1], np.int64).tobytes()
    tensor.sparse_csr.col_indices = np.array([0], np.int64).tobytes()
    with pytest.raises(CodecError, match="2-D"):
        decode_forward_backward(msg.SerializeToString())
    tensor.shape[:] = [2, 2]
    with pytest.raises(CodecError, match="sparse_csr"):
        decode_forward_backward(msg.SerializeToString())


def test_zstd_bomb_truncation_and_trailing_data_refused() -> None:
    body = zstandard.ZstdCompressor().compress(b"\0" * 10_000)
    with pytest.raises(CodecError, match="exceeds"):
        decode_forward_backward(body, "zstd", max_decompressed_bytes=1000)
    # a streamed frame carries no content size; the limit must still hold
    stream = zstandard.ZstdCompressor().compressobj()
    bomb = stream.compress(b"\0" * 50_000_000) + stream.flush()
    with pytest.raises(CodecError, match="exceeds"):
        decode_forward_backward(bomb, "zstd", max_decompressed_bytes=1 << 20)
    good, _ = client_post([sft_datum(list(range(500)))], compress=True)
    with pytest.raises(CodecError, match="truncated"):
        decode_forward_backward(good[:-3], "zstd")
    with pytest.raises(CodecError, match="after the zstd frame"):
        decode_forward_backward(good + good, "zstd")


# ------------------------------------------------------------------ responses


def test_forward_backward_output_parsed_by_client() -> None:
    lp0, lp1 = [-0.5, -1.25, -3.0], [-0.1]
    outputs = [
        {"logprobs": (lp0, "float32"), "elementwise_loss": ([0.5, 1.25, 3.0], "float32")},
        # pre-packed little-endian buffers are accepted too
        {"logprobs": (np.float32(lp1).tobytes(), "float32"),
         "elementwise_loss": (memoryview(np.float32([0.1]).tobytes()), "float32")},
    ]
    metrics = {"loss:sum": 4.85, "tokens:sum": 4, "lr:mean": 1e-4}
    raw = encode_forward_backward_output(outputs, metrics)
    out = deserialize_proto_response(raw, types.ForwardBackwardOutput)
    assert isinstance(out, types.ForwardBackwardOutput)
    assert out.loss_fn_output_type == "ArrayRecord"
    assert out.metrics == metrics
    assert len(out.loss_fn_outputs) == 2
    first = out.loss_fn_outputs[0]["logprobs"]
    assert (first.dtype, first.shape, first.data) == ("float32", [3], lp0)
    assert out.loss_fn_outputs[1]["logprobs"].data == f32(lp1)
    assert out.loss_fn_outputs[1]["elementwise_loss"].data == f32([0.1])
    # The client reduces metrics even for a single chunk; loss:sum must survive.
    combined = combine_fwd_bwd_output_results([out, out])
    assert combined.metrics["loss:sum"] == pytest.approx(2 * 4.85)
    assert len(combined.loss_fn_outputs) == 4


def test_forward_backward_output_matches_reference_vector() -> None:
    raw = encode_forward_backward_output([{"logprobs": ([-0.5, -1.25], "float32")}],
                                         {"loss:sum": 1.25})
    assert raw.hex() == (
        "0a0b41727261795265636f7264122e122a0a086c6f6770726f6273121e0a08000000bf0000a0bf1210000000"
        "00000000000800000000000000180118011a130a086c6f73733a73756d11000000000000f43f"
    )


def test_forward_backward_output_trailing_shapes_and_int64() -> None:
    outputs = [
        {"logprobs": TensorIn("float32", [2, 3], [-1.0] * 6), "ids": ([4, 5], "int64")},
        {"logprobs": TensorIn("float32", [1, 3], [-2.0] * 3), "ids": ([2**40], "int64")},
        # a different K starts a new ArrayRecord; the client concatenates records
        {"logprobs": TensorIn("float32", [2, 2], [-3.0] * 4), "ids": ([], "int64")},
    ]
    out = deserialize_proto_response(
        encode_forward_backward_output(outputs, {}, "foo.bar:ForwardOutput"),
        types.ForwardBackwardOutput,
    )
    assert out.loss_fn_output_type == "ForwardOutput"
    shapes = [o["logprobs"].shape for o in out.loss_fn_outputs]
    assert shapes == [[2, 3], [1, 3], [2, 2]]
    assert [o["ids"].data for o in out.loss_fn_outputs] == [[4, 5], [2**40], []]
    assert out.loss_fn_outputs[1]["ids"].dtype == "int64"


def test_forward_backward_output_rejects_bad_metric_keys_and_fields() -> None:
    for key in ("loss", "loss:avg", "a:b:sum"):
        with pytest.raises(ValueError, match="metric key"):
            encode_forward_backward_output([], {key: 1.0})
    with pytest.raises(ValueError, match="fields"):
        encode_forward_backward_output(
            [{"logprobs": ([0.0], "float32")}, {"other": ([0.0], "float32")}], {}
        )


def test_sample_response_parsed_by_client() -> None:
    seqs = [
        SampledOut(tokens=[10, 11, 151645], logprobs=[-0.1, -0.2, -0.3], stop_reason="stop"),
        {"tokens": [12, 13], "logprobs": [-1.5, -2.5], "stop_reason": "length"},
    ]
    raw = encode_sample_response(seqs, [None, -2.0, -0.75, None], prompt_cache_hit_tokens=3)
    resp = deserialize_proto_response(raw, types.SampleResponse)
    # The client stamps the ids from the asample submit answer onto the sequences.
    resp = _attach_sequence_ids(resp, ["s-0", "s-1"])
    assert [s.sequence_id for s in resp.sequences] == ["s-0", "s-1"]
    assert [s.tokens for s in resp.sequences] == [[10, 11, 151645], [12, 13]]
    assert resp.sequences[0].logprobs == f32([-0.1, -0.2, -0.3])
    assert resp.sequences[1].logprobs == [-1.5, -2.5]
    assert [s.stop_reason for s in resp.sequences] == ["stop", "length"]
    assert resp.prompt_logprobs == [None, -2.0, -0.75, None]
    assert resp.prompt_cache_hit_tokens == 3
    assert resp.topk_prompt_logprobs is None and resp.prompt_alt_tokens is None


def test_sample_response_without_optional_parts() -> None:
    raw = encode_sample_response([{"tokens": [1], "logprobs": None, "stop_reason": "length"}])
    resp = deserialize_proto_response(raw, types.SampleResponse)
    assert resp.prompt_logprobs is None
    assert resp.sequences[0].logprobs is None and resp.sequences[0].tokens == [1]
    with pytest.raises(ValueError, match="stop_reason"):
        encode_sample_response([{"tokens": [1], "logprobs": None, "stop_reason": "eos"}])
    with pytest.raises(ValueError, match="logprobs"):
        encode_sample_response([{"tokens": [1, 2], "logprobs": [0.0], "stop_reason": "stop"}])


def test_future_encoders_for_engine_results() -> None:
    torch = pytest.importorskip("torch")
    from tinker_shim.output_codec import fwdbwd_encoder
    from tinker_shim.sample_codec import sample_encoder

    result = SimpleNamespace(
        outputs=[
            {"logprobs": torch.tensor([-0.5, -2.0]), "elementwise_loss": [0.5, 2.0]},
            {"logprobs": torch.tensor([[-1.0, -3.0]], dtype=torch.bfloat16),
             "elementwise_loss": torch.tensor([[1.0, 3.0]], dtype=torch.float64)},
        ],
        metrics={"loss:sum": 2.5},
    )
    payload, content_type = fwdbwd_encoder(result)
    assert content_type == "application/x-protobuf"
    out = deserialize_proto_response(payload, types.ForwardBackwardOutput)
    assert [o["logprobs"].data for o in out.loss_fn_outputs] == [[-0.5, -2.0], [-1.0, -3.0]]
    assert out.loss_fn_outputs[1]["elementwise_loss"].shape == [1, 2]
    assert out.metrics == {"loss:sum": 2.5}

    from twinkled.protocol.types import SampledSequence, SampleResult

    sample = SampleResult([SampledSequence([3, 4], [-0.25, -0.5], "length")], [None, -1.0])
    payload, content_type = sample_encoder(sample)
    resp = deserialize_proto_response(payload, types.SampleResponse)
    assert resp.sequences[0].tokens == [3, 4] and resp.sequences[0].stop_reason == "length"
    assert resp.prompt_logprobs == [None, -1.0]


def test_codec_imports_neither_torch_nor_tinker() -> None:
    code = (
        "import sys, tinker_shim.codec;"
        "bad = {'torch', 'tinker', 'numpy'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
