"""One choice's answer, built as its tokens arrive: text deltas (incremental detokenization,
end-of-sequence, stop strings cut out), the tokens each delta covers, and how it finished.

A streamed answer sends the deltas as they come; a whole answer joins them, so both give
the same text for the same tokens. Text that may be the start of a stop string is held
back until it is known not to be one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twinkled.core.streams import Piece

from .tokens import Detokenizer, TextSide


@dataclass
class TokenOut:
    token: int
    logprob: float | None  # None: a prompt's first token (echo), which has no context
    top: list[tuple[int, float]]
    offset: int  # where the token's text starts in the choice's text


@dataclass
class Delta:
    text: str
    tokens: list[TokenOut]
    finish: str | None = None


@dataclass
class ChoiceText:
    side: TextSide
    stops: list[str]
    # Each token's place in the text is wanted (logprobs): decode token by token. Without
    # it and without stop strings, a piece is decoded in one go: 0.5 us a token against 25
    # token by token (4096 tokens, one CPU core).
    offsets: bool = True
    text: str = ""  # everything decoded so far (cut at a stop string once one is seen)
    sent: int = 0  # how much of `text` is given out
    count: int = 0  # completion tokens
    finish: str | None = None
    stopped_at: str | None = None  # the stop string that ended the text, if one did
    _pending: list[TokenOut] = field(default_factory=list)
    _detok: Detokenizer | None = None

    def __post_init__(self) -> None:
        self._detok = Detokenizer(self.side.decode)
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, piece: Piece) -> list[Delta]:
        """The deltas that the piece's tokens make ready (the last one finishes the choice
        when the piece does)."""
        if not self.stops and not self.offsets:
            return self._feed_whole(piece)
        out: list[Delta] = []
        for i, token in enumerate(piece.tokens):
            if self.finish is not None:
                break  # past a stop string: the engine's own check stops a token later
            top = []
            if piece.top is not None:
                top = list(zip(piece.top[0][i], piece.top[1][i], strict=True))
            self.count += 1
            self._pending.append(TokenOut(token, piece.logprobs[i], top, len(self.text)))
            if token in self.side.eos_ids:
                self._add(self._detok.flush())
                self.finish = self.finish or "stop"
                break
            self._add(self._detok.add(token))
            if self.finish is None:
                ready = len(self.text) - self._hold if self.stops else len(self.text)
                if ready > self.sent:
                    out.append(self._take(ready))
        if self.finish is None and piece.finish is not None:
            self._add(self._detok.flush())
            self.finish = self.finish or piece.finish
        if self.finish is not None:
            last = self._take(len(self.text))
            last.finish = self.finish
            out.append(last)
        return out

    def _feed_whole(self, piece: Piece) -> list[Delta]:
        if self.finish is not None:
            return []
        tokens = piece.tokens
        end = next((i for i, t in enumerate(tokens) if t in self.side.eos_ids), None)
        self.count += len(tokens) if end is None else end + 1
        self._add(self._detok.extend(tokens if end is None else tokens[:end]))
        if end is not None or piece.finish is not None:
            self._add(self._detok.flush())
            self.finish = "stop" if end is not None else piece.finish
        if self.finish is None and len(self.text) == self.sent:
            return []
        last = self._take(len(self.text))
        last.finish = self.finish
        return [last]

    def _add(self, delta: str) -> None:
        if not delta or self.finish is not None:
            return
        start = max(0, len(self.text) - self._hold)
        self.text += delta
        cuts = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stops)
                if i >= 0]
        if cuts:
            at, self.stopped_at = min(cuts, key=lambda c: c[0])
            self.text, self.finish = self.text[:at], "stop"

    def _take(self, upto: int) -> Delta:
        d = Delta(self.text[self.sent:upto], self._pending)
        self.sent, self._pending = max(self.sent, upto), []
        return d


# -- logprobs in the two shapes OpenAI gives them ------------------------------------------

def completion_logprobs(side: TextSide, tokens: list[TokenOut], top: bool = True,
                        shift: int = 0) -> dict:
    """`/completions`' logprobs object (`top`: with the top-k alternatives; `shift`: where
    the tokens' text starts in the choice's, after an echoed prompt)."""
    return {"tokens": [side.token_text(t.token) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [None if t.logprob is None else
                             {side.token_text(i): lp for i, lp in t.top} for t in tokens]
            if top else None,
            "text_offset": [shift + t.offset for t in tokens]}


def chat_logprobs(side: TextSide, tokens: list[TokenOut]) -> dict:
    """`/chat/completions`' logprobs object."""
    def entry(token: int, lp: float) -> dict:
        return {"token": side.token_text(token), "logprob": lp,
                "bytes": list(side.token_bytes(token))}

    return {"content": [{**entry(t.token, t.logprob),
                         "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in tokens]}
