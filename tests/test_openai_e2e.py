"""The official `openai` client against a real `twinkled serve` process (/oai/api/v1)."""

from __future__ import annotations

import http.client
import json
import os
import time

import pytest
from helpers import importorskip_deferred

openai = importorskip_deferred("openai")
tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

T = 120
PROMPT = "the sun and the sea"


def client(daemon, tenant="alice", key=None):
    return openai.OpenAI(base_url=f"{daemon.url}/oai/api/v1",
                         api_key=key or daemon.keys[tenant], max_retries=0, timeout=T)


def streamed(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    """Text and finish reason per choice, and the usage, from streamed chunks."""
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            text[c.index] = text.get(c.index, "") + (piece or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return text, finish, usage


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from openai_shim.tokens import TextSide

    return TextSide.load(tiny_dir, {})


def test_models_list_the_base_model(daemon, tiny_dir):
    c = client(daemon)
    ids = [m.id for m in c.models.list().data]
    assert ids[0] == tiny_dir.name
    assert c.models.retrieve(tiny_dir.name).id == tiny_dir.name
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_completion_whole_and_streamed_agree(daemon, tiny_dir, tok):
    c = client(daemon)
    kw = dict(model=tiny_dir.name, prompt=PROMPT, max_tokens=12, temperature=0)
    whole = c.completions.create(**kw)
    assert whole.object == "text_completion"
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    text, finish, usage = streamed(c.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert text == {0: choice.text} and finish == {0: "length"}
    assert usage.completion_tokens == 12 and usage.prompt_tokens == whole.usage.prompt_tokens
    # A prompt of token ids is the same prompt.
    ids = c.completions.create(**{**kw, "prompt": tok.encode(PROMPT)})
    assert ids.choices[0].text == choice.text


def test_chat_whole_and_streamed_agree_with_n_and_seed(daemon, tiny_dir, tok):
    c = client(daemon)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    kw = dict(model=tiny_dir.name, messages=messages, max_completion_tokens=8,
              temperature=1.0, seed=7, n=3)
    whole = c.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    assert whole.object == "chat.completion" and len(whole.choices) == 3
    assert [ch.index for ch in whole.choices] == [0, 1, 2]
    assert whole.usage.prompt_tokens == len(tok.chat(messages))
    made = 0
    for ch in whole.choices:
        assert ch.message.role == "assistant"
        lps = ch.logprobs.content
        made += len(lps)
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in lps)
        # Each token's bytes put together are the text (no end-of-sequence token here).
        if ch.finish_reason == "length":
            assert b"".join(bytes(e.bytes) for e in lps).decode() == ch.message.content
    assert whole.usage.completion_tokens == made
    text, finish, _ = streamed(c.chat.completions.create(**kw, stream=True))
    assert text == {ch.index: ch.message.content for ch in whole.choices}
    assert finish == {ch.index: ch.finish_reason for ch in whole.choices}
    # The tokenizer and chat template run in the HTTP process, which stays torch-free.
    assert "libtorch" not in open(f"/proc/{daemon.proc.pid}/maps").read()


def test_responses_api_answers_as_the_chat_does_whole_and_streamed(daemon, tiny_dir, tok):
    """`client.responses.create`: instructions and input items are the chat's system and
    user messages; the answer (greedy) is the chat completion's, whole and streamed."""
    c = client(daemon)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    chat = c.chat.completions.create(model=tiny_dir.name, messages=messages, max_tokens=6,
                                     temperature=0)
    kw = dict(model=tiny_dir.name, instructions="be brief", max_output_tokens=6, temperature=0,
              input=[{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}])
    r = c.responses.create(**kw)
    assert r.object == "response" and r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(tok.chat(messages)), 6)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    events = list(c.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        r.output_text == events[-1].response.output_text
    # A plain string input is one user message.
    one = c.responses.create(model=tiny_dir.name, input="hello", max_output_tokens=6,
                             temperature=0)
    assert one.output_text == c.chat.completions.create(
        model=tiny_dir.name, messages=messages[1:], max_tokens=6,
        temperature=0).choices[0].message.content
    for bad, param in ((dict(tools=[{"type": "function", "name": "f", "parameters": {}}]),
                        "tools"),
                       (dict(previous_response_id="resp_x"), "previous_response_id"),
                       (dict(text={"format": {"type": "json_object"}}), "text.format"),
                       (dict(input=[{"type": "function_call_output", "call_id": "x",
                                     "output": "y"}]), "input[0]"),
                       (dict(max_output_tokens=0), "max_output_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(**{**kw, **bad})
        assert e.value.body["param"] == param, e.value.body


def test_completion_logprobs_and_several_prompts(daemon, tiny_dir):
    c = client(daemon)
    r = c.completions.create(model=tiny_dir.name, prompt=["hello world", PROMPT], n=2,
                             max_tokens=5, temperature=0.9, seed=1, logprobs=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    for ch in r.choices:
        lp = ch.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert all(len(top) <= 3 for top in lp.top_logprobs)
        assert "".join(lp.tokens) == ch.text
    assert r.usage.completion_tokens == 20


def test_echo_gives_the_prompt_and_its_logprobs_as_tinker_scores_them(daemon, tiny_dir, tok):
    c = client(daemon)
    ids = tok.encode(PROMPT)
    kw = dict(model=tiny_dir.name, prompt=PROMPT, echo=True, logprobs=1, temperature=0)
    r = c.completions.create(**kw, max_tokens=0)
    ch = r.choices[0]
    assert ch.text == PROMPT and ch.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = ch.logprobs
    assert "".join(lp.tokens) == PROMPT and lp.token_logprobs[0] is None
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    want = sc.create_sampling_client(base_model=tiny_dir.name).result(timeout=T).compute_logprobs(
        tinker.types.ModelInput.from_ints(ids)).result(timeout=T)
    assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
    one = c.completions.create(**kw, max_tokens=2)
    assert one.choices[0].text.startswith(PROMPT) and one.usage.completion_tokens == 2
    assert len(one.choices[0].logprobs.tokens) == len(ids) + 2
    assert one.choices[0].logprobs.text_offset[len(ids)] == len(PROMPT)
    text, _, _ = streamed(c.completions.create(**kw, max_tokens=2, stream=True))
    assert text == {0: one.choices[0].text}


def test_a_repeated_prompt_reports_cached_tokens(daemon, tiny_dir):
    """The sampler's prefix cache (on by default) serves a prompt's full pages the second
    time: OpenAI's usage.prompt_tokens_details, Tinker's prompt_cache_hit_tokens and
    /metrics say so, and the answer is the same."""
    c = client(daemon, "bob")
    ids = list(range(40, 40 + 37))  # 2 full pages of 16, and a part
    kw = dict(model=tiny_dir.name, prompt=ids, max_tokens=3, temperature=0)
    cached = daemon.metric("twinkle_prompt_tokens_total", tenant="bob", source="cached")
    first, second = (c.completions.create(**kw) for _ in range(2))
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    assert second.choices[0].text == first.choices[0].text
    assert daemon.metric("twinkle_prompt_tokens_total", tenant="bob",
                         source="cached") - cached >= 32
    assert daemon.metric("twinkle_prompt_tokens_total", tenant="bob", source="prefilled") > 0
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["bob"])
    sampler = sc.create_sampling_client(base_model=tiny_dir.name).result(timeout=T)
    got = sampler.sample(tinker.types.ModelInput.from_ints(ids), 1,
                         tinker.types.SamplingParams(max_tokens=2, temperature=0.0)).result(timeout=T)
    assert got.prompt_cache_hit_tokens == 32


def test_stop_strings_cut_the_text(daemon, tiny_dir):
    c = client(daemon)
    kw = dict(model=tiny_dir.name, prompt=PROMPT, max_tokens=16, temperature=0)
    full = c.completions.create(**kw).choices[0].text
    stop = full[3:5]  # found at or after index 3
    cut = full[:full.index(stop)]
    r = c.completions.create(**kw, stop=[stop, "never appears"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    text, finish, _ = streamed(c.completions.create(**kw, stop=stop, stream=True))
    assert text == {0: cut} and finish == {0: "stop"}
    # Chat: the tiny model's chat reply is newlines only, so a stop found in it cuts at 0,
    # which a chat path answering "" to any stop would pass too. So also: a stop that is
    # not in the reply leaves it whole (finish "length"), one that is cuts it ("stop").
    chat_kw = dict(model=tiny_dir.name, max_tokens=16, temperature=0,
                   messages=[{"role": "user", "content": PROMPT}])
    reply = c.chat.completions.create(**chat_kw).choices[0].message.content
    assert reply
    absent = c.chat.completions.create(**chat_kw, stop=["never appears"]).choices[0]
    assert absent.message.content == reply and absent.finish_reason == "length"
    cut = c.chat.completions.create(**chat_kw, stop=reply[2:4]).choices[0]
    assert cut.message.content == reply[:reply.index(reply[2:4])]
    assert cut.finish_reason == "stop"


def test_a_trained_adapter_answers_as_tinker_samples_it(daemon, tiny_dir):
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4, seed=0).result(timeout=T)
    tk = tc.get_tokenizer()
    ids = tk("hello world from twinkle, yes.").input_ids
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]})
    for _ in range(2):
        tc.forward_backward([datum], "cross_entropy").result(timeout=T)
        tc.optim_step(tinker.types.AdamParams(learning_rate=5e-2)).result(timeout=T)
    path = tc.save_weights_for_sampler("oai").result(timeout=T).path
    prompt = tk(PROMPT).input_ids
    params = tinker.types.SamplingParams(max_tokens=6, temperature=0.8, seed=11)
    want = sc.create_sampling_client(model_path=path).result(timeout=T).sample(
        tinker.types.ModelInput.from_ints(prompt), 1, params).result(timeout=T).sequences[0]

    c = client(daemon)
    kw = dict(prompt=prompt, max_tokens=6, temperature=0.8, seed=11, logprobs=0)
    got = c.completions.create(model=path, **kw).choices[0]
    assert got.text == tk.decode(want.tokens, skip_special_tokens=True)
    assert got.logprobs.token_logprobs == pytest.approx(want.logprobs[:len(got.logprobs.tokens)],
                                                        abs=1e-4)
    assert path in [m.id for m in c.models.list().data]
    assert c.models.retrieve(path).id == path  # (its slashes and all)
    # The sampling session the Tinker client made on that path names the same weights.
    session = tc.model_id.split(":train:")[0]
    rest = tinker.RestClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    sampler = rest.get_session(session).result(timeout=T).sampler_ids[-1]
    for name in (sampler, f"tinker://{sampler}"):
        assert c.completions.create(model=name, **kw).choices[0].text == got.text
    base = c.completions.create(model=tiny_dir.name, **kw).choices[0]
    assert base.logprobs.token_logprobs != pytest.approx(got.logprobs.token_logprobs, abs=1e-4)

    # Another tenant's sampler path is not found, like an unknown one.
    with pytest.raises(openai.NotFoundError) as e:
        client(daemon, "bob").completions.create(model=path, **kw)
    assert e.value.body["code"] == "model_not_found"
    assert path not in [m.id for m in client(daemon, "bob").models.list().data]
    with pytest.raises(openai.NotFoundError):
        client(daemon, "bob").models.retrieve(path)


def test_top_k_one_is_greedy(daemon, tiny_dir):
    """`top_k` (vLLM's extension, passed through extra_body): with 1, any temperature and
    seed draw the most likely token."""
    kw = dict(model=tiny_dir.name, prompt=PROMPT, max_tokens=8)
    greedy = client(daemon).completions.create(**kw, temperature=0).choices[0].text
    for seed in (1, 2):
        got = client(daemon).completions.create(**kw, temperature=1.0, seed=seed,
                                                extra_body={"top_k": 1})
        assert got.choices[0].text == greedy
    with pytest.raises(openai.BadRequestError) as e:
        client(daemon).completions.create(**kw, extra_body={"top_k": 0})
    assert e.value.body["param"] == "top_k"


@pytest.mark.parametrize(("bad", "param"), [
    ({"temperature": 5}, "temperature"), ({"max_tokens": 100000}, "max_tokens"),
    ({"n": 0}, "n"), ({"top_p": "high"}, "top_p"), ({"presence_penalty": 1}, "presence_penalty"),
])
def test_bad_parameters_are_named(daemon, tiny_dir, bad, param):
    kw = {"model": tiny_dir.name, "prompt": "hi", "max_tokens": 2, **bad}
    with pytest.raises(openai.BadRequestError) as e:
        client(daemon).completions.create(**kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_an_image_for_a_text_model_is_named(daemon, tiny_dir):
    import base64

    from test_vlm import _png

    url = "data:image/png;base64," + base64.b64encode(_png(56, 56)).decode()
    with pytest.raises(openai.BadRequestError, match="takes no images") as e:
        client(daemon).chat.completions.create(model=tiny_dir.name, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    assert e.value.body["param"] == "messages[0].content[0].image_url"


def _post(daemon, path, body, key) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=T)
    conn.request("POST", f"/oai/api/v1/{path}", json.dumps(body),
                 {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_errors_in_openai_shape(daemon, tiny_dir):
    status, body = _post(daemon, "chat/completions", {"model": tiny_dir.name},
                         daemon.keys["alice"])
    assert status == 400 and body["error"]["param"] == "messages"
    hi = [{"role": "user", "content": "hi"}]
    status, body = _post(daemon, "chat/completions", {"model": tiny_dir.name, "messages": hi,
                                                       "tools": [{"type": "function"}]},
                         daemon.keys["alice"])
    assert status == 400 and body["error"]["param"] == "tools"
    with pytest.raises(openai.NotFoundError) as e:
        client(daemon).chat.completions.create(model="no-such-model", messages=[
            {"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        client(daemon, key="tml-not-a-key").models.list()


def test_a_client_gone_mid_stream_leaves_the_daemon_serving(daemon, tiny_dir):
    """A client that goes away (mid-stream, or before its answer) has its samples cancelled
    (counted per tenant in /metrics), and the daemon goes on serving. 1500 greedy tokens
    (the tiny model repeats itself, no EOS) take seconds: still running when it goes."""
    cancelled = daemon.metric("twinkle_samples_cancelled_total", tenant="bob")
    for body in ({"prompt": PROMPT, "max_tokens": 1500, "n": 2, "stream": True},
                 {"prompt": PROMPT, "max_tokens": 1500, "n": 2}):
        conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=T)
        conn.request("POST", "/oai/api/v1/completions",
                     json.dumps({"model": tiny_dir.name, "temperature": 0, **body}),
                     {"Authorization": f"Bearer {daemon.keys['bob']}",
                      "Content-Type": "application/json"})
        if body.get("stream"):
            r = conn.getresponse()
            assert r.status == 200
            r.fp.readline()  # the first bytes of the stream, then gone
        conn.sock.close()
        conn.close()
    deadline = time.monotonic() + T  # a bound on waiting, not on speed
    while daemon.metric("twinkle_samples_cancelled_total", tenant="bob") < cancelled + 2:
        assert time.monotonic() < deadline, "the gone clients' samples were not cancelled"
        time.sleep(0.2)
    r = client(daemon, "bob").completions.create(model=tiny_dir.name, prompt="hi", max_tokens=3,
                                                  temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert daemon.health()["status"] == "ok"


def test_detokenizing_keeps_characters_split_across_tokens_whole(tok):
    from openai_shim.choices import ChoiceText
    from twinkled.core.streams import Piece

    text = "héllo → 日本 the sun"
    ids = tok.encode(text)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # some token is part of a character
    choice = ChoiceText(tok, [])
    deltas = [d for i in ids for d in choice.feed(Piece(0, [i], [0.0]))]
    deltas += choice.feed(Piece(0, [], [], finish="length"))
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == text
    # Pieces of several tokens (decoded in one go), split inside a character: the same text.
    split = next(i for i, t in enumerate(ids) if tok.decode([t]) == "\ufffd") + 1
    whole = ChoiceText(tok, [], offsets=False)
    out = whole.feed(Piece(0, ids[:split], [0.0] * split))
    out += whole.feed(Piece(0, ids[split:], [0.0] * (len(ids) - split), finish="length"))
    assert all("\ufffd" not in d.text for d in out) and "".join(d.text for d in out) == text
    assert whole.count == len(ids) and out[-1].finish == "length"
    cut = ChoiceText(tok, ["日本"])
    out = cut.feed(Piece(0, ids, [0.0] * len(ids), finish="length"))
    assert "".join(d.text for d in out) == "héllo → " and cut.finish == "stop"


def test_a_long_text_is_counted_in_pieces_that_tokenize_as_the_whole(tok):
    """Issue 28 item 1: a text past the vocabulary's bound is counted piece by piece (each
    cut where the pre-tokenizer splits) before it is tokenized whole; the pieces' tokens
    are the text's, so the count refuses no prompt that fits."""
    import random

    from openai_shim import tokens

    rng = random.Random(0)
    words = ["the", "sun", " ", "sea!", "é✓", "\n", "12345", "<|im_end|>", "x" * 50, "'s"]
    text = "".join(rng.choice(words) + rng.choice([" ", "", "  ", "\n "])
                   for _ in range(3 * tokens._PIECE_CHARS // 4))
    n = len(tok.tok.encode(text, add_special_tokens=False))
    assert len(text) > 2 * tokens._PIECE_CHARS
    assert tok.reaches(text, n) and not tok.reaches(text, n + 1)
    assert tok.reaches("the sun and the sea " * (30 * 2**20 // 20), 2048)
    assert tok.max_chars(2048) == 2048 * tok.chars_per_token
