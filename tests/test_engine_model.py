"""Loading base models: the tiny builder, the supported architectures, our forward pass."""

from __future__ import annotations

import pytest
import torch

from twinkled.engine.model import BaseModel
from twinkled.engine.tiny import build_tiny_model
from twinkled.protocol.types import EngineInputError


def test_tiny_builder_is_offline_and_fast(tmp_path, monkeypatch):
    import socket

    def no_network(*a, **kw):
        raise AssertionError("the tiny model builder opened a network connection")

    # Offline: any attempt to connect anywhere fails the build (no time bound: its speed
    # is the suite's own business, not an assertion).
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    out = build_tiny_model(tmp_path / "m")
    monkeypatch.undo()
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}],
        tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    # Labels go on the assistant's tokens only: the mask is set, and not everywhere.
    assert 0 < sum(ids["assistant_masks"]) < len(ids["input_ids"])
    assert tok.decode(ids["input_ids"]).startswith("<|im_start|>user\nhello<|im_end|>")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_forward_matches_transformers(arch_dirs, arch):
    m = BaseModel(arch_dirs[arch])
    assert m.config.model_type == arch
    ids = torch.randint(0, m.vocab_size, (3, 21), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(21).expand(3, -1)
    with torch.no_grad():
        ours = m.logits(m.forward(ids, positions))
        ref = m.hf(input_ids=ids).logits
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0)


def test_dtype_and_device_are_honoured(tiny_dir):
    m = BaseModel(tiny_dir, dtype="bfloat16", device="cpu")
    assert m.hf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(not p.requires_grad for p in m.hf.parameters())
    with pytest.raises(EngineInputError, match="dtype"):
        BaseModel(tiny_dir, dtype="float8")


def test_unsupported_or_missing_model_is_refused(tmp_path, tiny_dir):
    with pytest.raises(EngineInputError, match="not a Hugging Face model directory"):
        BaseModel(tmp_path)
    cfg = (tiny_dir / "config.json").read_text().replace('"qwen3"', '"gpt2"')
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(EngineInputError, match="architecture 'gpt2' is not supported"):
        BaseModel(tmp_path)


def test_training_never_modifies_base_weights(tiny_dir):
    from helpers import ce_request, make_engine

    eng = make_engine(tiny_dir)
    before = {k: v.clone() for k, v in eng.model.hf.state_dict().items()}
    eng.add_adapter("a")
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        eng.forward_backward([ce_request("a", gen, eng.model.vocab_size, [12, 7])])
        assert eng.optim_step("a").applied
    after = eng.model.hf.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
