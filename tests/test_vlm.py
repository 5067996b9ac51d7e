"""Qwen2.5-VL and Qwen3-VL: images at the door (protocol/images.py), mRoPE positions
(engine/mrope.py) and the engine's forward with the frozen tower spliced in (engine/vision.py;
Qwen3-VL's DeepStack: engine/deepstack.py), each against transformers' own model on a tiny
random-weight one of each (fp32)."""

from __future__ import annotations

import io
import json
import struct
import zlib
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from twinkled.engine import mrope
from twinkled.engine.packed import Packing
from twinkled.engine.tiny import build_tiny_model
from twinkled.engine.vision import Images
from twinkled.protocol import images as im


def _png(w: int, h: int, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _png_header_only(w: int, h: int) -> bytes:
    """A PNG that claims w x h pixels (a decompression bomb's header) with no pixels."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def vl_dir(request, tmp_path_factory):
    # (Qwen3-VL: three text layers, two with DeepStack features added and one without;
    # Qwen3.5: a linear-attention layer and a full one, with its image processor's files)
    return build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param,
                            num_layers=3 if request.param.startswith("qwen3_vl") else 2,
                            images=True)


def _lora(vl_dir, seed: int):
    """A test adapter's config. An MoE model's experts take none here: peft's form of
    expert LoRA (target_parameters) is checked against ours by tests/test_engine_moe.py."""
    from twinkled.protocol.types import LoraConfig

    moe = json.loads((vl_dir / "config.json").read_text())["model_type"].endswith("_moe")
    return LoraConfig(rank=4, seed=seed, train_mlp=not moe)


@pytest.fixture(scope="module")
def spec(vl_dir):
    return im.VisionSpec.from_dir(vl_dir)


@pytest.fixture(scope="module")
def hf(vl_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()


def test_patches_equal_the_models_own_image_processor(vl_dir, spec):
    from PIL import Image
    from transformers import AutoImageProcessor

    data = _png(90, 61)
    got = im.prepare(data, "png", spec, im.ImageLimits())
    want = AutoImageProcessor.from_pretrained(vl_dir, use_fast=False)(
        images=[Image.open(io.BytesIO(data)).convert("RGB")])
    assert got.grid_thw == tuple(int(x) for x in want["image_grid_thw"][0])
    np.testing.assert_allclose(got.pixel_values, np.asarray(want["pixel_values"]), atol=1e-5)
    assert got.tokens == got.pixel_values.shape[0] // 4 == 6  # 84 x 56 px: 6 x 4 patches / 4


def test_smart_resize_equals_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    for h, w in [(61, 90), (1, 150), (3000, 4000), (28, 28), (999, 17), (5000, 40)]:
        assert im.smart_resize(h, w, 28, 56 * 56, 28 * 28 * 1280) == smart_resize(
            h, w, 28, 56 * 56, 28 * 28 * 1280)


@pytest.mark.parametrize("data,fmt,expected,message", [
    (_png(56, 56)[:200], "png", None, "cannot decode the png image"),
    (_png_header_only(20_000, 20_000), "png", None, "over image_max_pixels"),
    (_png(56, 56), "jpeg", None, "not a jpeg file"),
    (b"GIF89a....", "gif", None, "format 'gif' is not served"),
    (_png(56, 56), "png", 5, "expected_tokens is 5 but the image is 4 tokens"),
])
def test_bad_images_are_refused_by_name(spec, data, fmt, expected, message):
    with pytest.raises(im.ImageError, match=message):
        im.prepare(data, fmt, spec, im.ImageLimits(), expected_tokens=expected)


def test_limits_and_pointers(spec, tmp_path):
    data = _png(56, 56)
    with pytest.raises(im.ImageError, match="over image_max_bytes"):
        im.prepare(data, "png", spec, im.ImageLimits(max_bytes=100))
    with pytest.raises(im.ImageError, match="over image_max_tokens"):
        im.prepare(data, "png", spec, im.ImageLimits(max_tokens=3))
    one = im.prepare(data, "png", spec, im.ImageLimits())
    with pytest.raises(im.ImageError, match="over request_max_image_tokens"):
        im.check_request([one, one], im.ImageLimits(request_max_tokens=7))
    (tmp_path / "a.png").write_bytes(data)
    with pytest.raises(im.ImageError, match="no image_dir is configured"):
        im.read_pointer(f"file://{tmp_path}/a.png", im.ImageLimits())
    limits = im.ImageLimits(image_dir=tmp_path / "imgs")
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "b.png").write_bytes(data)
    assert im.read_pointer(f"file://{tmp_path}/imgs/b.png", limits) == data
    with pytest.raises(im.ImageError, match="outside image_dir"):
        im.read_pointer(f"file://{tmp_path}/imgs/../a.png", limits)
    with pytest.raises(im.ImageError, match="only file:// paths"):
        im.read_pointer("https://example.invalid/a.png", limits)


def _image_prompt(vl_dir, spec, tokens_before: list[int], after: list[int], seed=0):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vl_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in
           ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")}
    img = im.prepare(_png(90, 61, seed), "png", spec, im.ImageLimits())
    row = (tokens_before + [ids["<|vision_start|>"]] + [ids["<|image_pad|>"]] * img.tokens
           + [ids["<|vision_end|>"]] + after)
    return row, img, ids["<|image_pad|>"]


def test_mrope_positions_equal_transformers(vl_dir, spec, hf):
    row, img, pad = _image_prompt(vl_dir, spec, [5, 6, 7], [8, 9, 10, 11])
    input_ids = torch.tensor([row])
    want, _ = hf.model.get_rope_index(input_ids, (input_ids == pad).int(),
                                      image_grid_thw=torch.tensor([img.grid_thw]))
    got = mrope.row_positions(row, pad, [img.grid_thw], spec.merge_size)
    assert torch.equal(got, want[:, 0])
    assert torch.equal(mrope.text_row(5), torch.arange(5).expand(3, -1))


def test_engine_forward_with_an_image_equals_transformers(vl_dir, spec, hf):
    """A packed micro-batch of an image row beside a text-only row: the image row's logits
    equal transformers' Qwen2.5-VL, the text row's equal those it has alone."""
    from twinkled.engine.model import BaseModel

    model = BaseModel(vl_dir)
    row, img, pad = _image_prompt(vl_dir, spec, [5, 6, 7], [8, 9, 10, 11])
    text = [12, 13, 14, 15, 16, 17]
    with torch.no_grad():
        # (mm_token_type_ids: without it transformers' model gives the image 1-D positions)
        want = hf(input_ids=torch.tensor([row]), mm_token_type_ids=(torch.tensor([row]) == pad).int(),
                  pixel_values=torch.from_numpy(img.pixel_values),
                  image_grid_thw=torch.tensor([img.grid_thw])).logits[0]
        want_text = hf(input_ids=torch.tensor([text])).logits[0]
        ids = torch.tensor([row + text])
        positions = mrope.packed([mrope.row_positions(row, pad, [img.grid_thw], 2),
                                  mrope.text_row(len(text))])
        index = (torch.tensor(row) == pad).nonzero()[:, 0]
        images = Images(torch.from_numpy(img.pixel_values), [img.grid_thw], index)
        h = model.forward(ids, positions, packing=Packing.of([len(row), len(text)], "cpu"),
                          images=images)
        logits = model.lm_head(h)[0]
        alone = model.lm_head(model.forward(torch.tensor([text]), torch.arange(6)[None]))[0]
    torch.testing.assert_close(logits[:len(row)], want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[len(row):], want_text, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(alone, want_text, atol=1e-4, rtol=1e-4)
    # The image changed the row: its embeddings were spliced in (not the pad token's).
    plain = model.lm_head(model.forward(torch.tensor([row]), positions[:, :, :len(row)]))[0]
    assert (plain[-1] - logits[len(row) - 1]).abs().max() > 1e-3


@contextmanager
def _peft(hf, adapter):
    """transformers' VL model with peft holding `adapter`'s weights (unloaded after):
    (the peft model, {our key: its (A, B) parameters})."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    names = sorted({k.rsplit(".", 1)[-1] for k in adapter.bank.shapes})
    pm = get_peft_model(hf, PeftLoraConfig(
        r=adapter.bank.rank, lora_alpha=adapter.config.alpha,
        target_modules=rf"(.*language_model.*\.({'|'.join(names)})|lm_head)"))
    try:
        named = dict(pm.named_parameters())
        params = {}
        for key in adapter.bank.shapes:
            theirs = key.replace("model.", "model.language_model.", 1)
            pa, pb = (named[f"base_model.model.{theirs}.lora_{x}.default.weight"] for x in "AB")
            pa.data.copy_(adapter.bank.A[key][adapter.slot])
            pb.data.copy_(adapter.bank.B[key][adapter.slot])
            params[key] = (pa, pb)
        yield pm, params
    finally:
        pm.unload()


def _peft_grads(hf, adapter, data, image_pad):
    """peft on transformers' VL model with `adapter`'s weights: each datum's summed target
    logprob's loss, backward; the LoRA gradients by our keys."""
    with _peft(hf, adapter) as (pm, params):
        lps = []
        for d in data:
            ids = torch.as_tensor(d.tokens)[None]
            extra = {} if not d.images else dict(
                mm_token_type_ids=(ids == image_pad).int(),
                pixel_values=torch.cat([torch.from_numpy(i.pixel_values) for i in d.images]),
                image_grid_thw=torch.tensor([i.grid_thw for i in d.images]))
            logits = pm(input_ids=ids, **extra).logits[0].float()
            lps.append(logits.log_softmax(-1).gather(1, d.loss_inputs["target_tokens"][:, None])[:, 0])
        loss = -sum((lp * d.loss_inputs["weights"]).sum() for lp, d in zip(lps, data, strict=True))
        loss.backward()
        return [lp.detach() for lp in lps], {k: (a.grad, b.grad) for k, (a, b) in params.items()}


@pytest.mark.parametrize("packed", [True, False])
def test_training_with_an_image_equals_transformers_and_peft(vl_dir, spec, hf, packed):
    """forward_backward of an image datum co-batched beside a text-only tenant: logprobs
    and LoRA gradients equal peft on transformers' Qwen2.5-VL; the text tenant's equal
    those it gets alone. Image positions carry weight 0."""
    from helpers import grads, make_engine, randomize_b, rel_diff

    from twinkled.protocol.types import Datum, ForwardBackwardRequest

    eng = make_engine(vl_dir, packed=packed)
    for i, name in enumerate(("vis", "txt")):
        eng.add_adapter(name, _lora(vl_dir, i + 1))
        randomize_b(eng, name, seed=10 + i, std=0.2)
    row, img, pad = _image_prompt(vl_dir, spec, [5, 6, 7], [8, 9, 10, 11])
    targets = torch.tensor(row[1:] + [12])
    weights = (torch.tensor(row) != pad).float()
    vis = Datum(row, {"target_tokens": targets, "weights": weights}, images=[img])
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(5, 1000, (9,), generator=gen)
    txt = Datum(text[:-1].tolist(), {"target_tokens": text[1:], "weights": torch.ones(8)})
    reqs = [ForwardBackwardRequest("vis", [vis], "cross_entropy"),
            ForwardBackwardRequest("txt", [txt], "cross_entropy")]
    together = eng.forward_backward(reqs)
    got = {n: grads(eng, n) for n in ("vis", "txt")}
    eng.zero_grad("txt")
    alone = eng.forward_backward([reqs[1]])
    torch.testing.assert_close(alone[0].outputs[0]["logprobs"], together[1].outputs[0]["logprobs"],
                               atol=1e-5, rtol=1e-5)
    # (gradients reach ~200 here: compared relative to their size)
    for key, (ga, gb) in grads(eng, "txt").items():
        assert rel_diff(got["txt"][key][0], ga) < 1e-4 and rel_diff(got["txt"][key][1], gb) < 1e-4
    lps, want = _peft_grads(hf, eng.pool.get("vis"), [vis], pad)
    torch.testing.assert_close(together[0].outputs[0]["logprobs"], lps[0], atol=1e-4, rtol=1e-4)
    assert want
    for key, (ga, gb) in want.items():
        assert rel_diff(got["vis"][key][0], ga) < 1e-4 and rel_diff(got["vis"][key][1], gb) < 1e-4


def test_a_text_model_given_an_image_names_the_model(tiny_dir):
    from types import SimpleNamespace

    from tinker_shim import images as door
    from tinker_shim.codec import DatumIn, ImageIn
    from twinkled.protocol.errors import UserError

    config = SimpleNamespace(model=tiny_dir)
    datum = DatumIn([1, 2], {}, images=[ImageIn(1, _png(56, 56), "png")])
    with pytest.raises(UserError, match="model 'tiny-qwen3' takes no images"):
        door.expand([datum], config, "tiny-qwen3")


def test_the_door_expands_images_and_refuses_a_placeholder_in_text(vl_dir, spec):
    """The tinker door counts an image's tokens as the model's processor does, and its
    frame (the model's own processor settings inside) patchifies in a worker as here."""
    import msgspec

    from tinker_shim import images as door
    from tinker_shim.codec import DatumIn, ImageIn
    from twinkled.protocol.config import Config
    from twinkled.protocol.errors import UserError
    from twinkled.protocol.frames import ImageF

    _, pad = door.model_vision(str(vl_dir))
    config = Config(model=vl_dir)
    ok = DatumIn([1, 2], {}, images=[ImageIn(1, _png(56, 56), "png")])
    out, images = door.expand([ok], config, "vl")
    assert out[0].tokens == [1, pad, pad, pad, pad, 2] and images[0][0].tokens == 4
    (frame,) = door.image_frames(images[0], config)
    worker = im.prepared_image(msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=ImageF))
    np.testing.assert_array_equal(worker.pixel_values,
                                  im.prepare(_png(56, 56), "png", spec, im.ImageLimits()).pixel_values)
    bad = DatumIn([1, pad], {}, images=[ImageIn(1, _png(56, 56), "png")])
    with pytest.raises(UserError, match=f"holds the image placeholder token \\({pad}\\)"):
        door.expand([bad], config, "vl")


@pytest.mark.parametrize("prefill,chunk", [("varlen", None), ("varlen", 7), ("padded", None)])
def test_sampling_with_images_equals_the_trainer(vl_dir, spec, prefill, chunk):
    """The running batch samples image prompts (prefill whole, chunked across the image, or
    padded) beside a text-only row: each sample's logprobs equal the training forward's
    (tested equal to transformers' above) on prompt + sample, so decode continued the
    mRoPE positions (the rope delta); a fan-out's samples agree; prompt logprobs equal the
    trainer's. The prefix cache serves an image prompt's pages to the same image only."""
    from helpers import make_engine, randomize_b

    from twinkled.engine import sampler
    from twinkled.engine.running import RunningBatch
    from twinkled.protocol.types import (
        Datum,
        ForwardBackwardRequest,
        SampleRequest,
        SamplingParams,
    )

    eng = make_engine(vl_dir)
    # Qwen3.5's running batch prefills varlen only and keeps no prefix cache (running.py)
    hybrid = eng.model.hybrid is not None
    if hybrid and prefill == "padded":
        pytest.skip("Qwen3.5 prefills varlen only")
    eng.add_adapter("a", _lora(vl_dir, 1))
    randomize_b(eng, "a", seed=3, std=0.3)
    row, img, _ = _image_prompt(vl_dir, spec, [5, 6, 7], list(range(30, 50)))  # 31 tokens
    other = im.prepare(_png(90, 61, 7), "png", spec, im.ImageLimits())

    vs, ve = row[3], row[4 + img.tokens]
    two = [5, vs] + row[4:4 + img.tokens] + [ve, 8, vs] + row[4:4 + img.tokens] + [ve, 9, 10]

    def trainer(seq, *images):
        d = Datum(seq[:-1], {"target_tokens": torch.tensor(seq[1:])}, images=list(images))
        return eng.forward([ForwardBackwardRequest("a", [d])])[0].outputs[0]["logprobs"]

    def check(result, *images, prompt=row):
        n = len(prompt)
        toks = result.sequences[0].tokens
        got = torch.tensor(result.sequences[0].logprobs)
        want = trainer(prompt + toks, *images)[n - 1:]
        # (rtol: Qwen3.5's recurrent decode and chunked training drift ~1e-4 apart)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        return toks

    batch = RunningBatch(eng.model, 8, prefix_cache=0.5, prefill=prefill, prefill_tokens=chunk)
    a = eng.pool.get("a")
    greedy = SamplingParams(8, 0.0)
    first = sampler.generate(eng.model, [
        SampleRequest("a", row, greedy, num_samples=2, prompt_logprobs=True, images=(img,)),
        SampleRequest(None, [12, 13, 14], greedy),
        SampleRequest("a", two, greedy, images=(other, img))], [a, None, a], batch=batch)
    toks = check(first[0], img)
    check(first[2], other, img, prompt=two)  # two images: the delta counts both
    assert first[0].sequences[1].tokens == toks
    torch.testing.assert_close(torch.tensor(first[0].prompt_logprobs[1:]),
                               trainer(row + toks, img)[:len(row) - 1], atol=1e-4, rtol=1e-4)
    alone = sampler.generate(eng.model, [SampleRequest(None, [12, 13, 14], greedy)], [None])
    assert first[1].sequences[0].tokens == alone[0].sequences[0].tokens
    # The same text with another image: never the first image's cached pages.
    (second,) = sampler.generate(eng.model, [SampleRequest("a", row, greedy, images=(other,))],
                                 [a], batch=batch)
    assert second.cached_tokens == 0 and check(second, other) != toks
    (again,) = sampler.generate(eng.model, [SampleRequest("a", row, greedy, images=(img,))],
                                [a], batch=batch)
    assert again.cached_tokens == (0 if hybrid else 16) and check(again, img) == toks


def test_greedy_sampling_with_an_image_equals_transformers_generate(vl_dir, spec, hf):
    """An adapter samples an image prompt greedily, its prefill chunked across the image (a
    piece takes its placeholders' rows of the tower's output, DeepStack levels included):
    the tokens are transformers' `generate` with peft, the logprobs its scores."""
    from helpers import make_engine, randomize_b

    from twinkled.engine import sampler
    from twinkled.engine.running import RunningBatch
    from twinkled.protocol.types import SampleRequest, SamplingParams

    eng = make_engine(vl_dir)
    eng.add_adapter("a", _lora(vl_dir, 1))
    randomize_b(eng, "a", seed=3, std=0.3)
    a = eng.pool.get("a")
    row, img, pad = _image_prompt(vl_dir, spec, [5, 6, 7], list(range(30, 40)))
    batch = RunningBatch(eng.model, 4, prefill="varlen", prefill_tokens=5)
    (got,) = sampler.generate(eng.model, [SampleRequest("a", row, SamplingParams(6, 0.0),
                                                        images=(img,))], [a], batch=batch)
    ids = torch.tensor([row])
    with _peft(hf, a) as (pm, _), torch.no_grad():
        out = pm.generate(input_ids=ids, mm_token_type_ids=(ids == pad).int(),
                          pixel_values=torch.from_numpy(img.pixel_values),
                          image_grid_thw=torch.tensor([img.grid_thw]), max_new_tokens=6,
                          do_sample=False, output_scores=True, return_dict_in_generate=True)
    want = out.sequences[0, len(row):]
    assert got.sequences[0].tokens == want.tolist()
    assert len(set(want.tolist())) > 1  # (not a degenerate repeat of one token)
    lps = [s[0].log_softmax(-1)[t].item() for s, t in zip(out.scores, want, strict=True)]
    assert got.sequences[0].logprobs == pytest.approx(lps, abs=1e-4)


def test_twinkle_sdk_rows_and_prompts_with_images(vl_dir, spec):
    """twinkle_sdk in this process: an ImageChunk in a row's input_ids trains as the engine's
    image datum does (its placeholders expanded, no loss on them), and in a sampling prompt
    samples as the engine's image request; the sampled row keeps the chunk."""
    from twinkle_sdk import ImageChunk, Sampler, SamplingParams, TransformersModel
    from twinkled.protocol.types import Datum, ForwardBackwardRequest, SampleRequest
    from twinkled.protocol.types import SamplingParams as EngineParams

    model = TransformersModel(str(vl_dir))
    model.add_adapter_to_model("a", {"r": 4})
    row, img, pad = _image_prompt(vl_dir, spec, [5, 6, 7], [8, 9, 10, 11])
    chunk = ImageChunk(_png(90, 61), "png")
    ids = row[:4] + [chunk] + row[4 + img.tokens:]
    got = model.forward_only([{"input_ids": ids, "labels": ids}])["loss"]
    eng = model.backend.engine
    datum = Datum(row[:-1], {"target_tokens": torch.tensor(row[1:])}, images=[img])
    lp = eng.forward([ForwardBackwardRequest("a", [datum])])[0].outputs[0]["logprobs"]
    assert got == pytest.approx(-lp[torch.tensor(row[1:]) != pad].mean().item(), rel=1e-5)

    (res,) = Sampler(model).sample([{"input_ids": ids}], SamplingParams(max_tokens=4,
                                                                        temperature=0.0))
    (want,) = eng.sample([SampleRequest("a", row, EngineParams(4, 0.0), images=(img,))])
    assert res.sequences[0].tokens == want.sequences[0].tokens
    assert res.sequences[0].logprobs == pytest.approx(want.sequences[0].logprobs, abs=1e-6)
    assert res.sequences[0].new_input_feature["input_ids"][4] is chunk
