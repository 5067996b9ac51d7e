"""`echo` on /completions: the prompt given back before the completion, with its tokens'
logprobs (what eval harnesses score a continuation by: echo, logprobs, max_tokens 0 or 1).
"""

from __future__ import annotations

from twinkled.core.streams import PromptScores

from .choices import Delta, TokenOut
from .tokens import Detokenizer, TextSide


def echoed(side: TextSide, ids: list[int], scores: PromptScores | None) -> Delta:
    """The prompt as a delta: its text and its tokens, each with its logprob under the
    model (None for the first) and top-k alternatives, if they were asked for."""
    detok = Detokenizer(side.decode)
    text, tokens = "", []
    lps = scores.logprobs if scores is not None else None
    top = scores.top if scores is not None else None
    for i, token in enumerate(ids):
        alts = list(zip(top[0][i], top[1][i], strict=True)) if top is not None else []
        tokens.append(TokenOut(token, lps[i] if lps is not None else None, alts, len(text)))
        text += detok.add(token)
    return Delta(text + detok.flush(), tokens)
