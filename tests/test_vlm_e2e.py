"""Qwen2.5-VL through the unmodified tinker client against a real `twinkled serve` (one
daemon for the module): an ImageChunk datum's logprobs equal transformers' own Qwen2.5-VL,
co-batched beside a text-only tenant whose results are unchanged; bad images are 400s
naming what is wrong, and no worker restarts; a broken torchvision installed changes
nothing."""

from __future__ import annotations

import os

import pytest
import torch

tinker = pytest.importorskip("tinker")

T = 120


@pytest.fixture(scope="module")
def vl_daemon(tmp_path_factory):
    from daemon import Daemon, make_key

    from twinkled.engine.tiny import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("vlm") / "tiny-qwen2_5_vl",
                             arch="qwen2_5_vl")
    data = tmp_path_factory.mktemp("vld")
    # A torchvision that fails to import (a +cpu torch beside the index's torchvision):
    # the daemon and its workers must not care (protocol/images.guard_torchvision).
    fake = tmp_path_factory.mktemp("tv") / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    path = os.pathsep.join(p for p in (str(fake.parent), os.environ.get("PYTHONPATH")) if p)
    d = Daemon(model, data, data / "twinkled.log", env={"PYTHONPATH": path})
    d.keys = {t: make_key(data, t) for t in ("alice", "bob")}
    d.model = model
    yield d
    d.stop()


def _png(w: int, h: int, seed: int = 0) -> bytes:
    from test_vlm import _png as png

    return png(w, h, seed)


def _hf_logprobs(hf, model_dir, ids, targets, image: bytes | None):
    from transformers import AutoImageProcessor

    ids = torch.tensor([ids])
    extra = {}
    if image is not None:
        import io

        from PIL import Image

        px = AutoImageProcessor.from_pretrained(model_dir, use_fast=False)(
            images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
        extra = dict(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                     mm_token_type_ids=(ids == hf.config.image_token_id).int())
    with torch.no_grad():
        logits = hf(input_ids=ids, **extra).logits[0].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(targets)[:, None])[:, 0]


def test_image_datum_through_tinker_equals_transformers(vl_daemon):
    d = vl_daemon
    clients = [tinker.ServiceClient(base_url=d.url, api_key=d.keys[t])
               .create_lora_training_client(base_model=d.model.name, rank=4, seed=1)
               .result(timeout=T) for t in ("alice", "bob")]
    tok = clients[0].get_tokenizer()
    vs, ve, pad = (tok.convert_tokens_to_ids(t) for t in
                   ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    image = _png(90, 61)  # 84 x 56 after resizing: 6 tokens
    before, after = [5, 6, 7, vs], [ve, 8, 9, 10, 11]
    n = len(before) + 6 + len(after)
    full = before + [pad] * 6 + after
    targets = full[1:] + [12]
    weights = [0.0 if t == pad else 1.0 for t in full]
    mi = tinker.types.ModelInput(chunks=[
        tinker.types.EncodedTextChunk(tokens=before),
        tinker.types.ImageChunk(data=image, format="png", expected_tokens=6),
        tinker.types.EncodedTextChunk(tokens=after)])
    datum = tinker.types.Datum(model_input=mi, loss_fn_inputs={
        "target_tokens": targets, "weights": weights})
    text = [20, 21, 22, 23, 24, 25, 26]
    tdatum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(text[:-1]),
                                loss_fn_inputs={"target_tokens": text[1:],
                                                "weights": [1.0] * 6})
    pids = d.workers()
    # Both in flight together: co-batched in one step.
    fa = clients[0].forward([datum], "cross_entropy")
    fb = clients[1].forward([tdatum], "cross_entropy")
    got = fa.result(timeout=T).loss_fn_outputs[0]["logprobs"].tolist()
    got_text = fb.result(timeout=T).loss_fn_outputs[0]["logprobs"].tolist()
    assert len(got) == n
    # A fresh adapter's B is zero: its logprobs are the base model's.
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(d.model, dtype=torch.float32)
    want = _hf_logprobs(hf, d.model, full, targets, image)
    assert torch.tensor(got) == pytest.approx(want, abs=1e-4)
    want_text = _hf_logprobs(hf, d.model, text[:-1], text[1:], None)
    assert torch.tensor(got_text) == pytest.approx(want_text, abs=1e-4)
    # The image mattered: the text after it differs from a run with the pad tokens' embeddings.
    plain = _hf_logprobs(hf, d.model, full, targets, None)
    assert (plain[-4:] - want[-4:]).abs().max() > 1e-3

    bad = {
        "expected_tokens is 5 but the image is 6 tokens": (image, "png", 5),
        "cannot decode the png image": (image[:300], "png", 6),
        "not a jpeg file": (image, "jpeg", 6),
    }
    for message, (data, fmt, expected) in bad.items():
        mi = tinker.types.ModelInput(chunks=[
            tinker.types.EncodedTextChunk(tokens=before),
            tinker.types.ImageChunk(data=data, format=fmt, expected_tokens=expected),
            tinker.types.EncodedTextChunk(tokens=after)])
        k = len(before) + expected + len(after)
        datum = tinker.types.Datum(model_input=mi, loss_fn_inputs={
            "target_tokens": [1] * k, "weights": [0.0] * k})
        with pytest.raises(tinker.BadRequestError, match=message):
            clients[0].forward([datum], "cross_entropy").result(timeout=T)
    assert d.workers() == pids  # refused at the door: no worker restarted
    # The door checked every image without torch: the HTTP process stays torch-free.
    assert "libtorch" not in open(f"/proc/{d.proc.pid}/maps").read()


def test_cookbook_vlm_classifier_examples_train(vl_daemon):
    """The cookbook's VLM classifier recipe as it builds its data (its Qwen3-VL renderer, an
    image part and a question, the class name as the answer, `datum_from_model_input_weights`)
    on local images, trained through the tinker client: the loss falls."""
    from PIL import Image
    from tinker_cookbook.renderers import ImagePart, Message, TextPart, get_renderer
    from tinker_cookbook.supervised.common import datum_from_model_input_weights
    from transformers import AutoImageProcessor

    d = vl_daemon
    client = (tinker.ServiceClient(base_url=d.url, api_key=d.keys["alice"])
              .create_lora_training_client(base_model=d.model.name, rank=8, seed=2)
              .result(timeout=T))
    # (the slow, PIL image processor: no torchvision)
    processor = AutoImageProcessor.from_pretrained(d.model, use_fast=False)
    renderer = get_renderer("qwen3_vl_instruct", tokenizer=client.get_tokenizer(),
                            image_processor=processor)
    data = []
    for colour, rgb in (("red", (220, 30, 30)), ("blue", (30, 30, 220))):
        messages = [
            Message(role="user", content=[
                ImagePart(type="image", image=Image.new("RGB", (64, 48), rgb)),
                TextPart(type="text", text="What is the name of the subject in this photo?")]),
            Message(role="assistant", content=[
                TextPart(type="text", text=f"The subject in this photo is: {colour}\n")])]
        data.append(datum_from_model_input_weights(
            *renderer.build_supervised_example(messages), max_length=512))
    assert all(any(c.type == "image" for c in x.model_input.chunks) for x in data)
    adam = tinker.types.AdamParams(learning_rate=2e-2)
    losses = []
    for _ in range(6):
        fb = client.forward_backward(data, "cross_entropy")
        opt = client.optim_step(adam)
        losses.append(fb.result(timeout=T).metrics["loss:sum"])
        opt.result(timeout=T)
    assert losses[-1] < 0.7 * losses[0], losses


def test_images_in_sampling_and_openai_chat_are_refused_by_name(vl_daemon):
    """Not served yet: a 400 saying so (never a hang or a 5xx the client retries)."""
    import openai

    d = vl_daemon
    sc = tinker.ServiceClient(base_url=d.url, api_key=d.keys["bob"])
    sampler = sc.create_sampling_client(base_model=d.model.name).result(timeout=T)
    prompt = tinker.types.ModelInput(chunks=[
        tinker.types.EncodedTextChunk(tokens=[5, 6]),
        tinker.types.ImageChunk(data=_png(56, 56), format="png", expected_tokens=4)])
    with pytest.raises(tinker.BadRequestError, match="images in sampling prompts"):
        sampler.sample(prompt, 1, tinker.types.SamplingParams(max_tokens=2)).result(timeout=T)
    client = openai.OpenAI(base_url=f"{d.url}/oai/api/v1", api_key=d.keys["bob"])
    url = "data:image/png;base64," + __import__("base64").b64encode(_png(56, 56)).decode()
    with pytest.raises(openai.BadRequestError, match="image_url parts are not served yet"):
        client.chat.completions.create(model=d.model.name, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is it?"}]}])
