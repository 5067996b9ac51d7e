"""The model's tokenizer in the HTTP process: text and chat messages to token ids, and ids
back to text, incrementally.

The Tinker face never needs it (its clients send token ids); OpenAI clients send text.
It is loaded once, on the first request that needs it, in a thread, through
`PreTrainedTokenizerFast` (a `tokenizer.json`), which does not import torch: the HTTP
process stays torch-free. A model without a `tokenizer.json` falls back to `AutoTokenizer`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .errors import bad_param


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (the GPT-2 scheme): the printable
    Latin-1 bytes stand for themselves, the others take code points 256, 257, ... in
    order. Inverted: stand-in character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()
# A normalizer (Qwen's NFC) may join characters: at most 4 code points make one (the
# longest canonical decomposition), so a token covers at most 4x its own characters.
_JOIN = 4
# Texts tokenize at most this many at a time: a tokenizer holds a few hundred bytes of
# state per character it reads, so a burst of long prompts is paid one after another,
# not all at once.
_TOKENIZING = 2
# A text longer than this is counted piece by piece before it is tokenized whole (a piece
# ends before a space that follows a non-space: every byte-level BPE pre-tokenizer splits
# there, so the pieces' tokens are the text's), and refused once it reaches the context:
# a long text costs a piece's memory, not the whole text's.
_PIECE_CHARS = 1 << 16
_CUT = re.compile(r"\S(?= )")


def _longest_token(tokenizer: Any) -> int | None:
    """How many characters of a text one token can stand for, at most; None where no
    bound holds (an added token that swallows the whitespace beside it).

    Byte-level vocabularies write each byte as one character, so a piece's length bounds
    the characters it covers (a character is at least one byte); SentencePiece pieces
    (`▁` for a space, `<0xE3>` for a byte) are never shorter than their text either."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: its vocabulary and added tokens as strings
        vocab = tokenizer.get_vocab()
        return max(map(len, vocab)) * _JOIN
    added = backend.get_added_tokens_decoder().values()
    if any(a.lstrip or a.rstrip for a in added):
        return None
    longest = max(map(len, backend.get_vocab(with_added_tokens=True)))
    return longest * (_JOIN if backend.normalizer is not None else 1)


class TextSide:
    """Prompts to ids and ids to text, with the model's end-of-sequence tokens."""

    def __init__(self, tokenizer: Any, model_config: dict):
        self.tok = tokenizer
        eos = {tokenizer.eos_token_id, *_ids(model_config.get("eos_token_id"))}
        self.eos_ids: frozenset[int] = frozenset(i for i in eos if i is not None)
        # The engine's stop-string check reads decoded text, EOS included: stopping at a
        # stop string must not mean running past the end of the answer.
        self.eos_texts = [t for t in (tokenizer.decode([i]) for i in sorted(self.eos_ids)) if t]
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self.chars_per_token = _longest_token(tokenizer)
        self._pool = ThreadPoolExecutor(_TOKENIZING, thread_name_prefix="tokenize")

    def max_chars(self, max_seq_len: int) -> int | None:
        """The longest text that may still be a prompt of this context: a longer one has
        at least `max_seq_len` tokens (no token stands for more than `chars_per_token`
        characters), so it is refused before it is tokenized (what a 30 MiB prompt cost
        was the tokenizer's memory, not the model's)."""
        return None if self.chars_per_token is None else max_seq_len * self.chars_per_token

    async def off_loop(self, fn: Callable, *args: Any) -> Any:
        """Tokenizing a long text takes a while: not on the event loop, and at most
        `_TOKENIZING` texts at once."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def reaches(self, text: str, tokens: int) -> bool:
        """Whether `text` has at least `tokens` tokens, counted in pieces of at most
        `_PIECE_CHARS`; False for a text that short (it is tokenized whole at once) or one
        that cannot be cut (no space after a non-space in a piece's length)."""
        if len(text) <= _PIECE_CHARS:
            return False
        count, start = 0, 0
        while start < len(text):
            end: int | None = len(text)
            if end - start > _PIECE_CHARS:
                end = None
                for m in _CUT.finditer(text, start + 1, start + _PIECE_CHARS):
                    end = m.end()
                if end is None:
                    return False
            count += len(self.tok.encode(text[start:end], add_special_tokens=False))
            if count >= tokens:
                return True
            start = end
        return False

    @classmethod
    def load(cls, model_dir: Path | str, model_config: dict) -> TextSide:
        if (Path(model_dir) / "tokenizer.json").exists():
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
        else:  # a slow-only tokenizer: this path imports torch, once
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(model_dir))
        return cls(tok, model_config)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True)

    def chat(self, messages: list[dict]) -> list[int]:
        """The conversation through the model's chat template, ready for the reply."""
        return self.encode_templated(self.chat_text(messages))

    def encode_templated(self, text: str) -> list[int]:
        """A templated text's ids (the template writes the special tokens itself)."""
        return self.tok.encode(text, add_special_tokens=False)

    def chat_text(self, messages: list[dict]) -> str:
        """The conversation through the model's chat template, as text."""
        if not getattr(self.tok, "chat_template", None):
            raise bad_param("messages", "this model's tokenizer has no chat template: use "
                            "/completions with a prompt")
        try:
            return self.tok.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=False)
        except Exception as e:  # a template that rejects the conversation (roles, order)
            raise bad_param("messages", f"the chat template rejected the messages: {e}") from None

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True,
                               clean_up_tokenization_spaces=False)

    def token_text(self, token: int) -> str:
        return self.tok.decode([token], skip_special_tokens=False,
                               clean_up_tokenization_spaces=False)

    def token_bytes(self, token: int) -> bytes:
        """The token's own bytes (part of a character, perhaps), as OpenAI's logprobs give."""
        piece = self.tok.convert_ids_to_tokens(token)
        if self._byte_level and piece is not None and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return self.token_text(token).encode()


def _ids(value) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return []


class Detokenizer:
    """The text of a growing list of tokens, delta by delta. A character whose bytes are
    split across tokens is held back until its last byte arrives, so no delta carries half
    of one (as U+FFFD)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self._start = 0  # decoding starts here: a token of context before the new ones
        self._read = 0  # tokens up to here are already in the text given out

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._delta(final=False)

    def extend(self, tokens: list[int]) -> str:
        """`add` for several tokens at once (one decode)."""
        self.ids.extend(tokens)
        return self._delta(final=False)

    def flush(self) -> str:
        """What is held back (an incomplete character at the very end, as U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._start:self._read])
        now = self._decode(self.ids[self._start:])
        if not final and (now.endswith("\ufffd") or len(now) <= len(before)):
            return ""  # mid-character (or nothing printable yet): wait for more tokens
        self._start, self._read = self._read, len(self.ids)
        return now[len(before):]


class TextSideSlot:
    """Where the app keeps its TextSide, loaded on first use (in a thread: it takes a
    second or so, and most daemons never see an OpenAI client)."""

    def __init__(self, model_dir: Path | str | None, model_config: dict):
        self._args = (model_dir, model_config)
        self._side: TextSide | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> TextSide:
        if self._side is None:
            async with self._lock:
                if self._side is None:
                    self._side = await asyncio.get_running_loop().run_in_executor(
                        None, TextSide.load, *self._args)
        return self._side
