"""Template: turns a row of chat messages into training tokens and loss labels.

The chat format itself comes from the tokenizer's own chat template (`apply_chat_template`),
so one generic Template serves every model whose tokenizer ships one. Which tokens are
trained on is found by rendering message prefixes and comparing token ids, never by
looking for model-specific marker strings, so it works for formats we have not seen.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

IGNORE_INDEX = -100

# Used only when a tokenizer has no chat template of its own (base models, hand-built
# tokenizers): plain ChatML, "<|im_start|>{role}\n{content}<|im_end|>\n" per message, with
# "<|im_start|>assistant\n" as the generation prompt. Qwen-family models were trained on
# exactly this; for others it is a reasonable neutral format for fine-tuning.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Template:
    """Encode "messages" rows with a model's chat template.

    `model_id` is a model directory, an `hf://` / `ms://` id in the local cache, or an already
    loaded tokenizer. `max_length` truncates encoded rows on the right. Extra keyword
    arguments go to `apply_chat_template` (e.g. `enable_thinking=False` for Qwen3).
    """

    def __init__(self, model_id: Any, max_length: int | None = None,
                 **chat_template_kwargs: Any) -> None:
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1, not {max_length}")
        if isinstance(model_id, (str, os.PathLike)):
            from transformers import AutoTokenizer

            from twinkle_sdk.hub import resolve_model_dir

            self.model_dir = resolve_model_dir(model_id)
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        else:
            self.model_dir = None
            self.tokenizer = model_id
        self.max_length = max_length
        self.chat_template_kwargs = chat_template_kwargs
        # None means "use the tokenizer's own"; we pass the fallback per call instead of
        # setting it on the tokenizer so a tokenizer shared with other code is not changed.
        self.uses_fallback = not getattr(self.tokenizer, "chat_template", None)
        self._chat_template = FALLBACK_CHAT_TEMPLATE if self.uses_fallback else None

    # -- primitives ---------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The chat-template text of `messages`."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=self._chat_template, **self.chat_template_kwargs)

    def tokenize(self, text: str) -> list[int]:
        # The rendered text already holds any BOS the template wants; adding special tokens
        # again would double it.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- encoding -----------------------------------------------------------------------

    def encode(self, row: Mapping[str, Any], add_generation_prompt: bool = False) -> dict[str, Any]:
        """The row's other fields plus `input_ids` and `labels` (lists of the same length).

        labels hold the token id on the tokens of assistant turns (content and the token that
        closes the turn) and -100 everywhere else. With `add_generation_prompt=True` the
        trailing assistant turns are dropped and the rest is encoded with the generation
        prompt appended, all labels -100: the prompt of an RL rollout. The row's "messages"
        then holds the prompt messages only, so that it matches its tokens.
        """
        messages = _messages_of(row)
        if add_generation_prompt:
            prompt = list(messages)
            while prompt and prompt[-1]["role"] == "assistant":
                prompt.pop()
            if not prompt:
                raise ValueError("row has only assistant messages: there is no prompt to encode")
            input_ids = self.tokenize(self.render(prompt, add_generation_prompt=True))
            labels = [IGNORE_INDEX] * len(input_ids)
            messages = prompt
        else:
            input_ids, labels = self._encode_with_labels(messages)
        if self.max_length is not None:
            input_ids, labels = input_ids[: self.max_length], labels[: self.max_length]
        out = {k: v for k, v in row.items() if k not in ("input_ids", "labels")}
        out["messages"] = messages
        out["input_ids"] = input_ids
        out["labels"] = labels
        return out

    def _encode_with_labels(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        full = self.tokenize(self.render(messages))
        labels = [IGNORE_INDEX] * len(full)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            # Tokens shared with "everything before this turn + generation prompt" are prompt;
            # the turn ends where "everything up to this turn" stops.
            prompt_ids = self._prefix_ids(messages[:i])
            turn_ids = self.tokenize(self.render(messages[: i + 1]))
            start = _common_prefix(prompt_ids, full)
            end = _common_prefix(turn_ids, full)
            if end < len(turn_ids):
                # The full conversation renders this turn differently from the prefix (e.g.
                # Qwen3 drops <think> blocks of earlier turns): end at the turn's closing token.
                end = self._find_turn_end(full, start, turn_ids)
            end = self._strip_trailing_whitespace(full, start, end)
            labels[start:end] = full[start:end]
        return full, labels

    def _prefix_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        try:
            return self.tokenize(self.render(messages, add_generation_prompt=True))
        except Exception:
            if messages:
                raise
            # Some templates refuse an empty conversation; then the turn starts at token 0.
            return []

    def _is_whitespace(self, token_id: int) -> bool:
        return self.decode([token_id]).strip() == ""

    def _find_turn_end(self, full: list[int], start: int, turn_ids: list[int]) -> int:
        # The closing token is the last non-whitespace token of the prefix rendering.
        closing = next((t for t in reversed(turn_ids) if not self._is_whitespace(t)), None)
        for j in range(start, len(full)):
            if full[j] == closing:
                return j + 1
        return len(full)

    def _strip_trailing_whitespace(self, full: list[int], start: int, end: int) -> int:
        # The separator after the end-of-turn token ("\n" in ChatML) is template glue, not
        # something the model generates before stopping, so it is not trained on.
        while end > start and self._is_whitespace(full[end - 1]):
            end -= 1
        return end


def _messages_of(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"row has no 'messages' list (keys: {sorted(row)}): run dataset.map(...) with a "
            "Preprocessor that produces messages before encoding")
    out = []
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
        # Arrow fills keys that only some messages have with None; templates test those
        # keys with `is defined`, so drop them rather than render "None".
        out.append({k: v for k, v in m.items() if v is not None or k == "content"})
        if out[-1]["content"] is None:
            out[-1]["content"] = ""
    return out


# The tokenizer's chat template already carries each model's format, so the model-specific
# names are aliases of the generic Template: the seed scripts' names work unchanged.
TEMPLATES: dict[str, type[Template]] = {
    "Template": Template,
    "Qwen3_5Template": Template,
    "Qwen3Template": Template,
    "Qwen2_5Template": Template,
    "Llama3Template": Template,
}


def get_template(name_or_template: str | Template | type[Template] = "Template",
                 model_id: Any = None, max_length: int | None = None,
                 **kwargs: Any) -> Template:
    """A Template from a registered name, a Template subclass, or an instance (returned as is)."""
    if isinstance(name_or_template, Template):
        if max_length is not None:
            name_or_template.max_length = max_length
        return name_or_template
    if isinstance(name_or_template, str):
        if name_or_template not in TEMPLATES:
            raise ValueError(f"unknown template {name_or_template!r}; valid names: "
                             f"{', '.join(sorted(TEMPLATES))}")
        cls = TEMPLATES[name_or_template]
    elif isinstance(name_or_template, type) and issubclass(name_or_template, Template):
        cls = name_or_template
    else:
        raise TypeError(f"template must be a name, a Template class or instance, "
                        f"not {type(name_or_template).__name__}")
    if model_id is None:
        raise ValueError("model_id is required to build a template (it names the tokenizer)")
    return cls(model_id, max_length=max_length, **kwargs)
