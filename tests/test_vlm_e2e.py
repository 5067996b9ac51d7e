"""Qwen2.5-VL through the unmodified tinker and openai clients against a real `twinkled
serve` (one daemon for the module): an ImageChunk datum's logprobs equal transformers' own
Qwen2.5-VL, co-batched beside a text-only tenant whose results are unchanged; sampling and
compute_logprobs with an image equal transformers' generate and forward (peft); the OpenAI
face answers a chat with an image_url; bad images are 400s naming what is wrong, and no
worker restarts; a broken torchvision installed changes nothing."""

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


def _peft_vl(model_dir, adapter_dir, into):
    """transformers' Qwen2.5-VL with peft loading our adapter: its files name the text stack
    as a text model's (model.layers.N), the VL model's is model.language_model.layers.N."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    into.mkdir()
    w = load_file(adapter_dir / "adapter_model.safetensors")
    save_file({k.replace("model.model.layers.", "model.model.language_model.layers."): v
               for k, v in w.items()}, into / "adapter_model.safetensors")
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    names = "|".join(config["target_modules"])
    config["target_modules"] = rf"(.*language_model.*\.({names})|lm_head)"
    (into / "adapter_config.json").write_text(json.dumps(config))
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(hf, into).eval()


def _vision_kw(pm, model_dir, ids, image: bytes) -> dict:
    """transformers' inputs for a row holding one image."""
    import io

    from PIL import Image
    from transformers import AutoImageProcessor

    px = AutoImageProcessor.from_pretrained(model_dir, use_fast=False)(
        images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
    return dict(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                mm_token_type_ids=(ids == pm.config.image_token_id).int())


def test_sampling_with_an_image_equals_transformers_generate(vl_daemon, tmp_path):
    """A trained adapter samples an image prompt through the tinker client (greedy, two
    samples, beside another tenant's text-only sample): the tokens are transformers'
    `generate` with peft, the logprobs its scores; compute_logprobs with the image is its
    forward's. Another image with the same text is never served the first one's cached
    KV; the same image again is."""
    from test_qwen35_moe_e2e import _export

    d = vl_daemon
    tc = (tinker.ServiceClient(base_url=d.url, api_key=d.keys["alice"])
          .create_lora_training_client(base_model=d.model.name, rank=4, seed=3)
          .result(timeout=T))
    tok = tc.get_tokenizer()
    vs, ve, pad = (tok.convert_tokens_to_ids(t) for t in
                   ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    images = _png(90, 61), _png(90, 61, seed=7)  # 6 tokens each
    text = list(range(30, 50))
    full = [5, 6, 7, vs] + [pad] * 6 + [ve] + text  # 31 tokens: one full KV page

    def prompt(image):
        return tinker.types.ModelInput(chunks=[
            tinker.types.EncodedTextChunk(tokens=full[:4]),
            tinker.types.ImageChunk(data=image, format="png", expected_tokens=6),
            tinker.types.EncodedTextChunk(tokens=full[10:])])

    datum = tinker.types.Datum(model_input=prompt(images[0]), loss_fn_inputs={
        "target_tokens": full[1:] + [60], "weights": [0.0] * 10 + [1.0] * 21})
    tc.forward_backward([datum], "cross_entropy").result(timeout=T)
    tc.optim_step(tinker.types.AdamParams(learning_rate=0.3)).result(timeout=T)
    _export(d, "alice", tc, tmp_path / "w")
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=T)
    bob = tinker.ServiceClient(base_url=d.url, api_key=d.keys["bob"]).create_sampling_client(
        base_model=d.model.name).result(timeout=T)
    greedy = tinker.types.SamplingParams(max_tokens=8, temperature=0.0)
    text_prompt = tinker.types.ModelInput.from_ints([12, 13, 14, 15])
    # In flight together: one running batch.
    fs = sampler.sample(prompt(images[0]), 2, greedy)
    fl = sampler.compute_logprobs(prompt(images[0]))
    fb = bob.sample(text_prompt, 1, greedy)
    got, scored, beside = fs.result(timeout=T), fl.result(timeout=T), fb.result(timeout=T)
    alone = bob.sample(text_prompt, 1, greedy).result(timeout=T)
    assert beside.sequences[0].tokens == alone.sequences[0].tokens
    other = sampler.sample(prompt(images[1]), 1, greedy).result(timeout=T)
    again = sampler.sample(prompt(images[0]), 1, greedy).result(timeout=T)
    assert other.prompt_cache_hit_tokens == 0 and again.prompt_cache_hit_tokens == 16

    pm = _peft_vl(d.model, tmp_path / "w", tmp_path / "peft")
    ids = torch.tensor([full])
    for image, result in ((images[0], got), (images[1], other), (images[0], again)):
        kw = _vision_kw(pm, d.model, ids, image)
        with torch.no_grad():
            want = pm.generate(input_ids=ids, max_new_tokens=8, do_sample=False, **kw)[0, 31:]
            seq = torch.cat([ids[0], want])[None]
            logits = pm(input_ids=seq, **_vision_kw(pm, d.model, seq, image)).logits[0]
        lps = logits.log_softmax(-1)[torch.arange(38), seq[0, 1:]]
        for s in result.sequences:
            assert s.tokens == want.tolist()
            assert s.logprobs == pytest.approx(lps[30:].tolist(), rel=1e-4, abs=1e-4)
        if result is got:
            assert scored[0] is None
            assert scored[1:] == pytest.approx(lps[:30].tolist(), rel=1e-4, abs=1e-4)
    assert other.sequences[0].tokens != got.sequences[0].tokens  # the image mattered


def test_openai_chat_with_an_image_and_bad_images(vl_daemon):
    """The official openai client: a chat with an image_url data URL is answered as
    transformers' generate answers the chat template's prompt (its one <|image_pad|> per
    image expanded to the image's tokens, as the processor does). Bad images, in a chat or
    a tinker sampling prompt, are 400s naming what is wrong; no worker restarts."""
    import base64

    import openai
    from test_vlm import _png_header_only
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    d = vl_daemon
    pids = d.workers()
    client = openai.OpenAI(base_url=f"{d.url}/oai/api/v1", api_key=d.keys["bob"])

    def chat(url: str, **kw):
        return client.chat.completions.create(model=d.model.name, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is it?"}]}], **kw)

    def data(raw: bytes, fmt: str = "png") -> str:
        return f"data:image/{fmt};base64," + base64.b64encode(raw).decode()

    image = _png(90, 61)  # 6 tokens
    got = chat(data(image), max_tokens=6, temperature=0, logprobs=True)
    tok = AutoTokenizer.from_pretrained(d.model)
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what is it?"}]}],
        add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(text.replace("<|image_pad|>", "<|image_pad|>" * 6),
                                   add_special_tokens=False)])
    assert got.usage.prompt_tokens == ids.shape[1]
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(d.model, dtype=torch.float32)
    with torch.no_grad():
        want = hf.generate(input_ids=ids, max_new_tokens=6, do_sample=False,
                           **_vision_kw(hf, d.model, ids, image))[0, ids.shape[1]:]
    assert got.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert len(got.choices[0].logprobs.content) == 6

    header = _png_header_only(20000, 20000)
    bad = {
        "remote image URLs are not fetched": "https://example.invalid/cat.png",
        "cannot decode the png image": data(image[:300]),
        "over image_max_pixels": data(header),
        "not a jpeg file": data(image, "jpeg"),
        "base64 payload does not decode": "data:image/png;base64,%%%",
        "must be a base64 data URL": "file:///etc/passwd",
    }
    for message, url in bad.items():
        with pytest.raises(openai.BadRequestError, match=message) as e:
            chat(url, max_tokens=2)
        assert e.value.body["param"] == "messages[0].content[0].image_url"
    sampler = (tinker.ServiceClient(base_url=d.url, api_key=d.keys["bob"])
               .create_sampling_client(base_model=d.model.name).result(timeout=T))
    prompt = tinker.types.ModelInput(chunks=[
        tinker.types.EncodedTextChunk(tokens=[5, 6]),
        tinker.types.ImageChunk(data=image, format="png", expected_tokens=4)])
    with pytest.raises(tinker.BadRequestError, match="prompt image 0: expected_tokens is 4 "
                       "but the image is 6 tokens"):
        sampler.sample(prompt, 1, tinker.types.SamplingParams(max_tokens=2)).result(timeout=T)
    pointer = tinker.types.ModelInput(chunks=[tinker.types.ImageAssetPointerChunk(
        format="png", location="file:///etc/cat.png", expected_tokens=4)])
    with pytest.raises(tinker.BadRequestError, match="no image_dir is configured"):
        sampler.sample(pointer, 1, tinker.types.SamplingParams(max_tokens=2)).result(timeout=T)
    # The Anthropic face: a base64 image block, as the OpenAI face's image_url.
    import anthropic

    ac = anthropic.Anthropic(base_url=f"{d.url}/anthropic", api_key=d.keys["bob"])
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}}
    msg = ac.messages.create(model=d.model.name, max_tokens=6, extra_body={"temperature": 0},
                             messages=[{"role": "user", "content": [
                                 block, {"type": "text", "text": "what is it?"}]}])
    assert msg.content[0].text == got.choices[0].message.content
    assert msg.usage.input_tokens == ids.shape[1]
    bad_block = {**block, "source": {**block["source"], "data": base64.b64encode(
        image[:300]).decode()}}
    with pytest.raises(anthropic.BadRequestError, match="messages.0.content.0: cannot decode"):
        ac.messages.create(model=d.model.name, max_tokens=2, messages=[
            {"role": "user", "content": [bad_block]}])
    assert d.workers() == pids
    # Chat and sampling images were checked at the door without torch, too.
    assert "libtorch" not in open(f"/proc/{d.proc.pid}/maps").read()


def test_twinkle_sdk_image_rows_on_the_daemon(vl_daemon):
    """twinkle_sdk against the daemon: a row with an ImageChunk trains as transformers
    scores it (a fresh adapter: the base model's), and a prompt with one samples."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    import twinkle_sdk as twinkle
    from twinkle_sdk.runtime import runtime

    d = vl_daemon
    tok = AutoTokenizer.from_pretrained(d.model)
    vs, ve, pad = (tok.convert_tokens_to_ids(t) for t in
                   ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    image = _png(90, 61)
    chunk = twinkle.ImageChunk(image, "png")
    ids = [5, 6, 7, vs, chunk, ve, 8, 9, 10, 11]
    full = [5, 6, 7, vs] + [pad] * 6 + [ve, 8, 9, 10, 11]
    before = runtime.client, runtime.mode
    try:
        twinkle.init_twinkle_client(d.url, d.keys["bob"])
        model = twinkle.MultiLoraTransformersModel(model_id=str(d.model))
        model.add_adapter_to_model("default", {"r": 4})
        loss = model.forward_only([{"input_ids": ids, "labels": ids}])["loss"]
        model.backend.sync_sampler()
        (res,) = twinkle.Sampler(model).sample([{"input_ids": ids}], twinkle.SamplingParams(
            max_tokens=3, temperature=0.0))
    finally:
        runtime.client, runtime.mode = before
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(d.model, dtype=torch.float32)
    lps = _hf_logprobs(hf, d.model, full[:-1], full[1:], image)
    assert loss == pytest.approx(-lps[torch.tensor(full[1:]) != pad].mean().item(), rel=1e-4)
    assert len(res.sequences[0].tokens) == 3
    assert res.sequences[0].new_input_feature["input_ids"][:len(ids)] == ids
