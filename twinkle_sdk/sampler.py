"""Sampling for RL loops, from the adapter a model trains: in this process (the model's own
engine, nothing to copy) or on the model's daemon (its weights saved to a sampler there)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .batch import IGNORE
from .images import ImageChunk


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | list[int] | None = None  # None: stop at end-of-sequence
    num_samples: int = 1
    logprobs: int = 1  # the sampled token's logprob is always returned


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]  # one per sampled token
    stop_reason: str
    text: str = ""
    # The prompt row with this completion appended: input_ids, labels on the completion,
    # and the prompt's messages plus an assistant message (what rewards read).
    new_input_feature: dict = field(default_factory=dict)


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]


class Sampler:
    """`Sampler(model)`: samples from `model`'s adapter (`use_adapter=False`: the base)."""

    def __init__(self, model: Any, use_adapter: bool = True, **_ignored):
        self.model = model
        self.use_adapter = use_adapter

    @property
    def tokenizer(self):
        return self.model.backend.tokenizer

    def set_template(self, name: str = "Template", **kwargs) -> None:
        self.model.set_template(name, **kwargs)

    def sync_weights(self) -> None:
        """Make the next samples use the adapter's current weights."""
        self.model.backend.sync_sampler()

    def sample(self, inputs: list[dict], sampling_params: SamplingParams | None = None
               ) -> list[SampleResponse]:
        """One response per input row (encoded with add_generation_prompt=True), each with
        `num_samples` sequences."""
        p = sampling_params or SamplingParams()
        params = {k: v for k, v in asdict(p).items() if k not in ("num_samples", "logprobs")}
        # (an ImageChunk stays in the prompt: the backend expands it, images.py)
        prompts = [[t if isinstance(t, ImageChunk) else int(t) for t in row["input_ids"]]
                   for row in inputs]
        out = self.model.backend.sample(prompts, params, p.num_samples, self.use_adapter)
        tok = self.tokenizer
        responses = []
        for row, prompt, seqs in zip(inputs, prompts, out, strict=True):
            sequences = []
            for tokens, logprobs, reason in seqs:
                text = tok.decode(tokens, skip_special_tokens=True)
                feature = {**row, "input_ids": prompt + tokens,
                           "labels": [IGNORE] * len(prompt) + list(tokens),
                           "messages": [*row.get("messages", []),
                                        {"role": "assistant", "content": text}]}
                sequences.append(SampledSequence(list(tokens), list(logprobs), reason, text,
                                                 feature))
            responses.append(SampleResponse(sequences))
        return responses
