"""The official `anthropic` client against a real `twinkled serve` process
(/anthropic/v1): the session's daemon that the OpenAI face's tests use too."""

from __future__ import annotations

import http.client
import json
import os

import pytest
from helpers import importorskip_deferred

anthropic = importorskip_deferred("anthropic")
tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

T = 120
HELLO = [{"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0}


def client(daemon, tenant="alice", key=None):
    return anthropic.Anthropic(base_url=f"{daemon.url}/anthropic",
                               api_key=key or daemon.keys[tenant], max_retries=0, timeout=T)


@pytest.fixture(scope="module")
def trained(daemon, tiny_dir):
    """Alice's adapter after two SFT steps, saved for sampling: its sampler path, and the
    Tinker sampling client on it (what the Anthropic face must answer as)."""
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4, seed=3).result(timeout=T)
    ids = tc.get_tokenizer()("a tiny chat, trained twice.").input_ids
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]})
    for _ in range(2):
        tc.forward_backward([datum], "cross_entropy").result(timeout=T)
        tc.optim_step(tinker.types.AdamParams(learning_rate=5e-2)).result(timeout=T)
    path = tc.save_weights_for_sampler("anthropic").result(timeout=T).path
    return path, sc.create_sampling_client(model_path=path).result(timeout=T)


def test_a_chat_with_a_trained_adapter_is_what_tinker_samples(daemon, tiny_dir, trained):
    from openai_shim.tokens import TextSide

    path, sampler = trained
    system = "be brief"
    # The 2.x SDK sends the sampling knobs as extra fields (older ones as arguments).
    msg = client(daemon).messages.create(model=path, max_tokens=7, extra_body=GREEDY,
                                         system=[{"type": "text", "text": system}],
                                         messages=HELLO, metadata={"user_id": "u1"})
    side = TextSide.load(tiny_dir, {})
    prompt = side.chat([{"role": "system", "content": system}, *HELLO])
    want = sampler.sample(tinker.types.ModelInput.from_ints(prompt), 1,
                          tinker.types.SamplingParams(max_tokens=7, temperature=0)
                          ).result(timeout=T).sequences[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.model == path
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == side.decode(want.tokens)
    assert msg.usage.input_tokens == len(prompt)
    assert msg.usage.output_tokens == len(want.tokens)
    # The tiny model repeats itself (no end-of-sequence token in 7 greedy tokens).
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    # A stop sequence cuts the text and is named.
    text = msg.content[0].text
    stop = text[1:3]
    cut = client(daemon).messages.create(model=path, max_tokens=7, extra_body=GREEDY,
                                         system=system, messages=HELLO, stop_sequences=[stop])
    assert cut.content[0].text == text[:text.index(stop)]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert [m.id for m in client(daemon).models.list()][:1] == [tiny_dir.name]
    assert path in [m.id for m in client(daemon).models.list()]
    assert client(daemon).models.retrieve(path).id == path
    # count_tokens counts what messages samples from.
    assert client(daemon).messages.count_tokens(
        model=path, system=system, messages=HELLO).input_tokens == len(prompt)


def test_a_stream_sends_anthropics_events_in_order_with_the_whole_text(daemon, tiny_dir):
    c = client(daemon)
    kw = dict(model=tiny_dir.name, max_tokens=9, extra_body={**GREEDY, "top_k": 5},
              messages=[*HELLO, {"role": "assistant", "content": "Well,"}])
    whole = c.messages.create(**kw)
    events = list(c.messages.create(**kw, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("content_block_delta")
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"], kinds
    assert deltas >= 1 and all(e.delta.type == "text_delta" for e in events[2:2 + deltas])
    assert "".join(e.delta.text for e in events[2:2 + deltas]) == whole.content[0].text
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    # top_k 1 draws the most likely token whatever the temperature.
    hot = c.messages.create(**{**kw, "extra_body": {"temperature": 1.0, "top_k": 1}})
    assert hot.content[0].text == whole.content[0].text
    # The SDK's own accumulation of the stream gives the same message.
    with c.messages.stream(**kw) as s:
        got = s.get_final_message()
    assert got.content[0].text == whole.content[0].text and got.usage == whole.usage


def _post(daemon, path, body, headers) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=T)
    conn.request("POST", f"/anthropic/v1/{path}", json.dumps(body),
                 {"Content-Type": "application/json", **headers})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_errors_in_anthropic_shape(daemon, tiny_dir, trained):
    c = client(daemon)
    with pytest.raises(anthropic.BadRequestError) as e:  # the SDK insists: a raw request
        c.post("/v1/messages", body={"model": tiny_dir.name, "messages": HELLO},
               cast_to=object)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("max_tokens")
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="no-such-model", max_tokens=2, messages=HELLO)
    assert e.value.body["error"]["type"] == "not_found_error"
    # Another tenant's adapter is "not found", like an unknown model.
    with pytest.raises(anthropic.NotFoundError):
        client(daemon, "bob").messages.create(model=trained[0], max_tokens=2, messages=HELLO)
    with pytest.raises(anthropic.NotFoundError) as e:
        client(daemon, "bob").models.retrieve(trained[0])
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(daemon, key="tml-not-a-key").messages.create(model=tiny_dir.name, max_tokens=2,
                                                            messages=HELLO)
    assert e.value.body["error"]["type"] == "authentication_error"
    for bad, where in (({"temperature": 1.5}, "temperature"),
                       ({"tools": [{"name": "f", "input_schema": {}}]}, "tools"),
                       ({"output_config": {"format": {"type": "json_schema"}}},
                        "output_config.format"),
                       ({"messages": [{"role": "user", "content": [
                           {"type": "image", "source": {}}]}]}, "messages.0.content.0")):
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model=tiny_dir.name, max_tokens=2, messages=HELLO,
                              extra_body=bad)
        assert e.value.body["error"]["message"].startswith(where), e.value.body
    # A Bearer key works too; a missing one is refused in Anthropic's shape.
    body = {"model": tiny_dir.name, "max_tokens": 1, "messages": HELLO}
    status, out = _post(daemon, "messages", body,
                        {"Authorization": f"Bearer {daemon.keys['alice']}"})
    assert status == 200 and out["usage"]["output_tokens"] == 1
    # max_tokens 0 only prefills the prompt (Anthropic's cache warming): an empty reply.
    status, out = _post(daemon, "messages", {**body, "max_tokens": 0},
                        {"x-api-key": daemon.keys["alice"]})
    assert status == 200 and out["content"] == [{"type": "text", "text": ""}]
    assert out["stop_reason"] == "max_tokens" and out["usage"]["output_tokens"] == 0
    status, out = _post(daemon, "messages", body, {})
    assert status == 401 and out["error"]["type"] == "authentication_error"
