"""Text in, text out, whatever the face: the one path the OpenAI and Anthropic faces share.

A face decodes and checks its own request body, then hands this module what it asked for
in face-neutral terms (`Knobs`, prompts, budgets): the `model` resolved to the base model
or sampler weights the key may read (models.py), prompts tokenized (tokens.py, the chat
template included), and each prompt queued as one sample op through the same service
command as Tinker's asample (`Service.sample_stream`: quotas, fair share, co-batching with
every other tenant's samples). The tokens come back as text deltas per choice (`Deltas`,
choices.py); the face writes them in its own shape, whole or streamed.

Errors are raised as `OpenAIError`s naming the parameter at fault; each face maps them to
its own error shape (the Anthropic face renames its parameters where they differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tinker_shim.common import limits, service
from tinker_shim.images import image_frames
from twinkled.core.streams import Piece, SampleStream
from twinkled.protocol.checks import check_prompt_scores, check_token_ids
from twinkled.protocol.frames import SampleF, SamplingF, buf
from twinkled.protocol.types import EngineInputError

from .choices import ChoiceText, Delta, TokenOut
from .echo import echoed
from .errors import bad_param
from .models import Target, resolve
from .streaming import freed_if_gone, merged
from .tokens import TextSide

GREEDY_BELOW = 1e-5  # a temperature this small is greedy sampling
# A chat's (and a response's) default in OpenAI's API is the rest of the context; the
# sampler reserves its KV cache for max_tokens up front, so a client that leaves it out
# gets at most this.
CHAT_MAX_TOKENS = 4096


@dataclass(frozen=True)
class Knobs:
    """How to sample, in the engine's terms (None: the default)."""

    temperature: float | None = None  # None: 1.0
    top_p: float | None = None  # None: 1.0
    top_k: int = -1  # -1: off
    seed: int | None = None
    n: int = 1  # choices per prompt


@dataclass
class Job:
    """One request, checked: what to sample and how to answer."""

    body: Any  # the face's own request, for what only that face reads (model, stream, ...)
    knobs: Knobs
    chat: bool
    target: Target
    side: TextSide
    stops: list[str]
    prompts: list[list[int]]
    max_tokens: list[int]
    topk: int = 0  # top-k logprobs per token
    logprobs: bool = False
    echo: bool = False  # the prompt comes back before each completion (completions only)
    images: list = field(default_factory=list)  # a chat's (protocol/images.CheckedImage)

    @property
    def sampled(self) -> bool:
        """False for echo with max_tokens 0: the prompt (and its scores) alone."""
        return min(self.max_tokens) > 0

    @property
    def n(self) -> int:
        return self.knobs.n


async def target_and_side(request: web.Request, model: str) -> tuple[Target, TextSide]:
    """What `model` names for this key, and the model's tokenizer."""
    return resolve(request, model), await request.app["oai_text"].get()


async def tokens(request, side: TextSide, param: str, text: str, encode) -> list[int]:
    """`text`'s ids, unless it cannot fit the context: refused by its length, or as soon
    as counting it in pieces reaches the context (tokenizing 30 MiB at once took
    gigabytes; a piece costs little)."""
    fits(request, side, param, len(text))
    ctx = limits(request).max_seq_len
    if await side.off_loop(side.reaches, text, ctx):
        raise bad_param(param, f"the prompt is more than {ctx} tokens, this model's context")
    return await side.off_loop(encode, text)


async def chat_ids(request, side: TextSide, param: str, messages: list[dict],
                   prefill: str = "") -> list[int]:
    """The conversation through the model's chat template, ready for the reply (which
    continues `prefill`, the start of the assistant's turn, if given)."""
    fits(request, side, param, len(prefill) + sum(
        len(m["content"]) + len(m.get("name") or "") for m in messages))
    text = await side.off_loop(side.chat_text, messages)
    return await tokens(request, side, param, text + prefill, side.encode_templated)


def fits(request, side: TextSide, param: str, length: int) -> None:
    """A prompt (characters of text, or token ids) that cannot fit the context is refused
    before it is tokenized or scored: tokenizing 30 MiB of text took gigabytes."""
    ctx = limits(request).max_seq_len
    most = side.max_chars(ctx)
    if most is not None and length > most:
        raise bad_param(param, f"the prompt is {length} characters: more than {ctx} tokens "
                        f"(this model's context) however it tokenizes (a token covers at "
                        f"most {side.chars_per_token} characters)")


def budgets(request, ids: list[list[int]], asked: int | None, param: str, prompt_param: str,
            default: int) -> list[int]:
    """Each prompt's max_tokens: as asked (within the context), else `default` (or the
    rest of the context, if less)."""
    lim = limits(request)
    ctx, out = lim.max_seq_len, []
    for p in ids:
        if len(p) >= ctx:
            raise bad_param(prompt_param, f"the prompt is {len(p)} tokens; this model's "
                            f"context is {ctx} tokens")
        try:
            check_token_ids(prompt_param, p, lim.vocab_size)
        except EngineInputError as e:
            raise bad_param(prompt_param, str(e)) from None
        if not p:
            raise bad_param(prompt_param, "the prompt is empty")
        if asked is None:
            out.append(min(default, ctx - len(p)))
        elif len(p) + asked > ctx:
            raise bad_param(param, f"{param} ({asked}) + the prompt ({len(p)} tokens) is "
                            f"more than this model's context of {ctx} tokens")
        else:
            out.append(asked)
    return out


def queue(request, job: Job, live: bool = True) -> list[SampleStream]:
    """One sample op per prompt, through the service's sample command (`live` False: an
    answer read whole, its pieces all at the end)."""
    k, svc = job.knobs, service(request)
    # Stop strings are cut out here (choices.py); the engine stops at them too, and at
    # the end-of-sequence tokens (which its stop-string check sees only as text).
    stop = [*job.stops, *job.side.eos_texts] if job.stops else None
    temperature = 1.0 if k.temperature is None else k.temperature
    if temperature < GREEDY_BELOW:  # dividing logits by it would overflow
        temperature = 0.0
    top_p = 1.0 if k.top_p is None else k.top_p
    streams: list[SampleStream] = []
    try:
        for p, max_tokens in zip(job.prompts, job.max_tokens, strict=True):
            # max_tokens 0 (echo): one token is sampled, and dropped.
            params = SamplingF(max(1, max_tokens), temperature, k.top_k, top_p, k.seed, stop)
            scored = job.echo and job.logprobs
            _check_scores(request, p, scored, job.topk if scored else 0, job.topk)
            frame = SampleF(job.target.adapter, buf(p, "int64"), params, job.n,
                            prompt_logprobs=scored, load_from=job.target.load_from,
                            topk_prompt=job.topk if scored else 0, topk_sample=job.topk,
                            images=image_frames(job.images, svc.config))
            streams.append(svc.sample_stream(request["tenant"], job.target.owner, frame, live))
    except BaseException:
        for s in streams:
            s.cancel()
        raise
    return streams


def _check_scores(request, prompt: list[int], scored: bool, topk_prompt: int,
                  topk: int) -> None:
    try:
        check_prompt_scores(prompt, scored, None, topk_prompt, topk, 0, None, limits(request))
    except EngineInputError as e:
        raise bad_param("logprobs", str(e)) from None


class Deltas:
    """Each choice's deltas from the pieces of its stream, the echoed prompt first."""

    def __init__(self, job: Job, streams: list[SampleStream]):
        self.job, self.streams = job, streams
        self.choices = [ChoiceText(job.side, job.stops, offsets=job.logprobs)
                        for _ in range(len(job.prompts) * job.n)]
        self._shift: dict[int, int] = {}  # choice -> length of its echoed prompt

    def of(self, stream: int, piece: Piece) -> tuple[int, list[Delta]]:
        job, c = self.job, stream * self.job.n + piece.choice
        out = []
        if job.echo and c not in self._shift:
            out.append(echoed(job.side, job.prompts[stream], self.streams[stream].prompt))
            self._shift[c] = len(out[0].text)
        if not job.sampled:
            self.choices[c].finish = "length"
            out.append(Delta("", [], "length"))
            return c, out
        made = self.choices[c].feed(piece)
        for d in made:
            for t in d.tokens:
                t.offset += self._shift.get(c, 0)
        return c, out + made

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.job.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.count for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the sampler's prefix cache served."""
        return sum(s.cached_tokens for s in self.streams)


async def whole(request, job: Job) -> tuple[Deltas, list[str], list[list[TokenOut]]]:
    """Every choice's text and tokens, once all are done (the client's going away frees
    its samples)."""
    streams = queue(request, job, live=False)
    deltas = Deltas(job, streams)
    texts = [""] * len(deltas.choices)
    toks: list[list[TokenOut]] = [[] for _ in deltas.choices]
    async with freed_if_gone(request, streams):
        async for i, piece in merged(streams):
            c, made = deltas.of(i, piece)
            for d in made:
                texts[c] += d.text
                toks[c].extend(d.tokens)
    return deltas, texts, toks
