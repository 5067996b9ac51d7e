"""What a sampling request asks to know about its prompt, from the prefill that serves it.

Tinker's SampleRequest can ask for the prompt tokens' logprobs (all, or only the last n),
the top-k tokens at each prompt position, the logprobs of chosen ids at chosen positions
(distillation targets) and k independent draws at every position. All of them read the
prompt's next-token distributions, computed here once per request, a slice of rows at a
time so a long prompt never holds [n, vocab] logits at once.

Row i (of n - 1) is the distribution after prompt tokens 0..i, i.e. over prompt token
i + 1; prompt token 0 has no context and is never scored.
"""

from __future__ import annotations

import torch

from twinkled.protocol.types import SampleRequest, SampleResult

from .lora import LoraBatch

ROWS_PER_SLICE = 512  # prompt positions whose logits exist at once


def wants_scores(req: SampleRequest) -> bool:
    return bool(req.prompt_logprobs or req.topk_prompt or req.target_prompt is not None
                or req.alt_tokens_k)


def score_prompt(model, req: SampleRequest, adapter, hidden: torch.Tensor,
                 ids: torch.Tensor, result: SampleResult) -> None:
    """Fill `result`'s prompt fields for `req`. `hidden` [n, d] and `ids` [n] are the
    request's prompt positions (no padding) from the batch's prefill."""
    n = ids.shape[0]
    # Positions before `first` are not scored for prompt logprobs and top-k (last_n).
    first = 1 if req.prompt_last_n is None else n - req.prompt_last_n
    full = req.target_prompt is not None or req.alt_tokens_k > 0
    lo = 0 if full else max(0, first - 1)  # the first row any answer needs
    lora = LoraBatch([adapter], model.dtype, model.device)
    lps: list[float | None] = [None] * n
    top_ids: list[list[int]] = [[] for _ in range(n)]
    top_lps: list[list[float]] = [[] for _ in range(n)]
    target = [[0.0] * len(row) for row in req.target_prompt or []]
    alt_ids: list[list[int]] = []
    alt_lps: list[list[float]] = []
    gen = _generator(req, model.device)
    for start in range(lo, n - 1, ROWS_PER_SLICE):
        stop = min(n - 1, start + ROWS_PER_SLICE)
        logp = torch.log_softmax(model.logits(hidden[None, start:stop], lora)[0].float(), -1)
        scored = max(start, first - 1)  # rows from here on are in the last-n window
        if req.prompt_logprobs and scored < stop:
            got = logp[scored - start:].gather(1, ids[scored + 1:stop + 1, None])[:, 0]
            lps[scored + 1:stop + 1] = got.tolist()
        if req.topk_prompt and scored < stop:
            k = min(req.topk_prompt, logp.shape[-1])
            v, t = logp[scored - start:].topk(k, dim=-1)
            top_ids[scored + 1:stop + 1] = t.tolist()
            top_lps[scored + 1:stop + 1] = v.tolist()
        if req.target_prompt is not None:
            _score_targets(logp, start, req.target_prompt, target)
        if req.alt_tokens_k:
            t, v = _draw(logp, req, gen)
            alt_ids += t.tolist()
            alt_lps += v.tolist()
    if req.prompt_logprobs:
        result.prompt_logprobs = lps
    if req.topk_prompt:
        result.topk_prompt = (top_ids, top_lps)
    if req.target_prompt is not None:
        result.target_prompt = target
    if req.alt_tokens_k:
        result.alt_tokens = (alt_ids, alt_lps)


def _score_targets(logp: torch.Tensor, start: int, wanted: list[list[int]],
                   out: list[list[float]]) -> None:
    """out[i][j] = logprob of wanted[i][j] at row i; cells of -1 stay 0.0."""
    rows = wanted[start:start + logp.shape[0]]
    if not rows or not rows[0]:
        return
    ids = torch.tensor(rows, device=logp.device)
    got = logp.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0)
    out[start:start + len(rows)] = got.tolist()


def _draw(logp: torch.Tensor, req: SampleRequest, gen: torch.Generator | None):
    """k draws with replacement per row at the request's temperature (0: the argmax, k
    times); each with its logprob under the distribution it was drawn from, as sampled
    tokens' logprobs are."""
    k, temp = req.alt_tokens_k, req.params.temperature
    if temp == 0:
        best = logp.argmax(-1, keepdim=True).expand(-1, k)
        return best, logp.gather(1, best)
    scaled = torch.log_softmax(logp / temp, -1) if temp != 1 else logp
    drawn = torch.multinomial(scaled.exp(), k, replacement=True, generator=gen)
    return drawn, scaled.gather(1, drawn)


def _generator(req: SampleRequest, device: torch.device) -> torch.Generator | None:
    if not req.alt_tokens_k or req.params.seed is None:
        return None
    # Not the sampling stream's seed exactly, so the draws do not mirror the first samples.
    return torch.Generator(device=device).manual_seed((req.params.seed + 1) % 2**63)
