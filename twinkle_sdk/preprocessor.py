"""Preprocessors: turn a dataset's own row format into the "messages" format Template encodes.

A preprocessor is a callable `row -> row | None` (None drops the row). Subclasses of
`Preprocessor` register themselves by class name, so `dataset.map("GSM8KProcessor")` and a
user's own subclass work by name the same way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Row = dict[str, Any]

PREPROCESSORS: dict[str, type[Preprocessor]] = {}


class Preprocessor:
    """Base class: override `__call__(row) -> row in messages format, or None to drop it`."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        PREPROCESSORS[cls.__name__] = cls

    def __call__(self, row: Row) -> Row | None:
        raise NotImplementedError


def get_preprocessor(name_or_obj: str | type | Callable[[Row], Row | None],
                     init_args: Mapping[str, Any] | None = None) -> Callable[[Row], Row | None]:
    """An instance from a registered name or a class (built with `init_args`), or the callable
    itself."""
    if isinstance(name_or_obj, str):
        if name_or_obj not in PREPROCESSORS:
            raise ValueError(f"unknown preprocessor {name_or_obj!r}; valid names: "
                             f"{', '.join(sorted(PREPROCESSORS))}")
        return PREPROCESSORS[name_or_obj](**dict(init_args or {}))
    if isinstance(name_or_obj, type):
        return name_or_obj(**dict(init_args or {}))
    if callable(name_or_obj):
        if init_args:
            # They would be silently ignored: the object is already built.
            raise ValueError("init_args apply only when the preprocessor is given by name or "
                             "class, not to an instance")
        return name_or_obj
    raise TypeError(f"preprocessor must be a name, a class or a callable, "
                    f"not {type(name_or_obj).__name__}")


def _msg(role: str, content: Any) -> dict[str, str]:
    return {"role": role, "content": "" if content is None else str(content)}


def _require(row: Mapping[str, Any], keys: tuple[str, ...], who: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise ValueError(f"{who}: row lacks {missing} (it has {sorted(row)})")


class SelfCognitionProcessor(Preprocessor):
    """The swift self-cognition dataset (query/response with {{NAME}}/{{AUTHOR}} placeholders).

    `model_name` / `model_author` may be one string or a (chinese, english) pair, chosen by
    the row's "tag" ("zh" or "en") as swift does. Output: messages [system?, user, assistant].
    """

    def __init__(self, model_name: str | tuple[str, str] | list[str],
                 model_author: str | tuple[str, str] | list[str],
                 system: str | None = None) -> None:
        self.model_name = self._pair(model_name)
        self.model_author = self._pair(model_author)
        self.system = system

    @staticmethod
    def _pair(value: str | tuple[str, str] | list[str]) -> tuple[str, str]:
        if isinstance(value, str):
            return value, value
        zh, en = value
        return zh, en

    def _fill(self, text: Any, zh: bool) -> str:
        i = 0 if zh else 1
        return (str(text).replace("{{NAME}}", self.model_name[i])
                .replace("{{AUTHOR}}", self.model_author[i]))

    def __call__(self, row: Row) -> Row | None:
        zh = row.get("tag") == "zh"
        if "messages" in row and row["messages"]:
            messages = [_msg(m["role"], self._fill(m["content"], zh)) for m in row["messages"]]
        else:
            _require(row, ("query", "response"), "SelfCognitionProcessor")
            messages = [_msg("user", self._fill(row["query"], zh)),
                        _msg("assistant", self._fill(row["response"], zh))]
        if self.system and messages[0]["role"] != "system":
            messages.insert(0, _msg("system", self.system))
        return {"messages": messages}


GSM8K_SYSTEM_PROMPT = (
    "You are a helpful math assistant. Solve the problem step by step, showing your reasoning. "
    "Then give the final answer as a number on the last line, after '####', e.g. '#### 42'."
)

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_final_answer(text: str) -> str | None:
    """The number after the last '####' in `text` (commas and '$' removed), or None."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].replace(",", "").replace("$", "")
    match = _NUMBER.search(tail)
    return match.group(0) if match else None


class GSM8KProcessor(Preprocessor):
    """GSM8K (question/answer) -> messages [system, user, assistant] plus `ground_truth`.

    `ground_truth` is the number after '####' in the reference answer: what RL rewards
    compare a completion's final answer with. The assistant turn holds the reference answer
    (for SFT); `encode(add_generation_prompt=True)` leaves it out of RL prompts. Rows with
    no '####' answer cannot be scored and are dropped.
    """

    def __init__(self, system: str | None = GSM8K_SYSTEM_PROMPT) -> None:
        self.system = system

    def __call__(self, row: Row) -> Row | None:
        _require(row, ("question", "answer"), "GSM8KProcessor")
        truth = extract_final_answer(str(row["answer"]))
        if truth is None:
            return None
        messages = [_msg("user", row["question"]), _msg("assistant", row["answer"])]
        if self.system:
            messages.insert(0, _msg("system", self.system))
        return {"messages": messages, "ground_truth": truth}


# ShareGPT and other exports name roles differently; the chat template wants these four.
ROLE_ALIASES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool",
}


class MessagesProcessor(Preprocessor):
    """Rows already in chat form: "messages" (role/content) or ShareGPT "conversations"
    (from/value). Roles are normalised, a "system" column becomes the first message, and
    other columns are kept as metadata. Rows with no messages are dropped."""

    def __init__(self, system: str | None = None) -> None:
        self.system = system

    def __call__(self, row: Row) -> Row | None:
        if "messages" in row:
            raw, key = row["messages"], "messages"
        elif "conversations" in row:
            raw, key = row["conversations"], "conversations"
        else:
            raise ValueError(f"MessagesProcessor: row has neither 'messages' nor "
                             f"'conversations' (it has {sorted(row)})")
        messages = []
        for m in raw or []:
            role = m.get("role", m.get("from"))
            content = m.get("content", m.get("value"))
            if role not in ROLE_ALIASES:
                raise ValueError(f"MessagesProcessor: unknown role {role!r}; known: "
                                 f"{', '.join(sorted(ROLE_ALIASES))}")
            messages.append(_msg(ROLE_ALIASES[role], content))
        if not messages:
            return None
        system = row.get("system") or self.system
        if system and messages[0]["role"] != "system":
            messages.insert(0, _msg("system", system))
        out = {k: v for k, v in row.items() if k not in (key, "system")}
        out["messages"] = messages
        return out


class AlpacaProcessor(Preprocessor):
    """Alpaca rows (instruction, optional input, output) -> [system?, user, assistant]."""

    def __init__(self, system: str | None = None) -> None:
        self.system = system

    def __call__(self, row: Row) -> Row | None:
        _require(row, ("instruction", "output"), "AlpacaProcessor")
        query = str(row["instruction"])
        if row.get("input"):
            query = f"{query}\n\n{row['input']}"
        messages = [_msg("user", query), _msg("assistant", row["output"])]
        system = row.get("system") or self.system
        if system:
            messages.insert(0, _msg("system", system))
        return {"messages": messages}
