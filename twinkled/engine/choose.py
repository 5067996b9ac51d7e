"""Choosing each row's next token, and when a row stops: shared by both sampling paths.

A row is greedy at temperature 0, else sampled after its top-k / top-p. Rows of a seeded
request draw together from that request's own generator (one `multinomial` over its rows,
in sample order), so a seed gives the same output whichever rows sit beside it.

Two ways to choose. `choose` (the reference) builds each row's log_softmax and draws by the
exponential race. `pick` (what `select` draws with) does that on a CPU; on CUDA one fused
kernel (kernels/sample_rows.py) draws the rows of requests without top-k / top-p: the logits
read about twice, nothing of [rows, vocab] written, where `choose` moves ~1.5 GB a step at
256 rows x 151,936 vocab (~15% of a Qwen2.5-0.5B decode step on an H200; the kernel makes
that step 14% shorter, BENCHMARKS.md session 17). It draws one uniform a row from the same
generators (a request's rows together, in sample order) and samples by inverse CDF: the
same distribution, other tokens than `choose` for the same seed. The rows of top-k / top-p
requests take `choose` among themselves, and a row's top-k logprobs come from the same
log_softmax whichever way its token was drawn: which way a request is drawn follows its own
parameters, so its seeded output never depends on the rows beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twinkled.protocol.types import SamplingParams

from . import kernels

# `pick` through the fused kernel where it applies (CUDA, no top-k / top-p); False: `choose`.
# On since its tests passed compiled on an H200 (`gpu_pass.sh gpucheck`) and it paid there:
# 0.5B fan-out 66.7k call tok/s against 57.2k with `choose`, 8B fan-out 1.04x
# (`bench_sampling.py --paths new,unfused`, BENCHMARKS.md session 17).
FUSED = True


@dataclass
class RowChoice:
    """Per-row sampling parameters of a batch, on the device."""

    temp: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] long, 0: off
    top_p: torch.Tensor  # [B] float32
    all_greedy: bool
    filtered: bool  # some row has a top-k or top-p
    # (rows, generator) per request with temperature > 0 (None: the global stream); rows
    # a slice where they are consecutive slots in sample order (one kernel draws them).
    groups: list[tuple[torch.Tensor | slice, torch.Generator | None]]
    # What lets `choose` skip a pass over [rows, vocab] (same results): every temperature
    # 0 or 1 (no division), none 0 (no greedy argmax), every row in a group (no ones).
    unit_temp: bool = False
    no_greedy: bool = False
    covered: bool = False
    # For `pick` through the kernel: the groups it draws uniforms for (those of requests
    # without top-k / top-p), and the rows of requests with them (`sifted_rows`, a tensor)
    # with their own RowChoice (`sifted`, its groups renumbered 0..n-1): those rows take
    # `choose` among themselves. So the way a request's tokens are drawn follows its own
    # parameters, never its neighbours' (a seeded request's tokens do not depend on them).
    plain_groups: list[tuple[torch.Tensor | slice, torch.Generator | None]] | None = None
    sifted: RowChoice | None = None
    sifted_rows: torch.Tensor | None = None

    @classmethod
    def of(cls, params: list[SamplingParams], groups: list[tuple[list[int], torch.Generator | None]],
           dev: torch.device) -> RowChoice:
        sifted = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        plain, split = groups, None
        if sifted and len(sifted) < len(params):  # (a request's rows share its parameters)
            at = {row: j for j, row in enumerate(sifted)}
            plain = [(idx, gen) for idx, gen in groups if idx and idx[0] not in at]
            split = cls.of([params[i] for i in sifted],
                           [([at[i] for i in idx], gen) for idx, gen in groups
                            if idx and idx[0] in at], dev)
        return cls(
            temp=torch.tensor([p.temperature for p in params], device=dev, dtype=torch.float32),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], device=dev),
            top_p=torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32),
            all_greedy=all(p.temperature == 0 for p in params),
            filtered=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
            groups=[(_rows(idx, dev), gen) for idx, gen in groups if idx],
            unit_temp=all(p.temperature in (0, 1) for p in params),
            no_greedy=bool(params) and all(p.temperature > 0 for p in params),
            covered=sum(len(idx) for idx, _ in groups) == len(params),
            plain_groups=[(_rows(idx, dev), gen) for idx, gen in plain if idx],
            sifted=split,
            sifted_rows=torch.tensor(sifted, device=dev) if split is not None else None)

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's token, its logprob, and the (temperature-scaled) distribution."""
        greedy = self.temp == 0
        logp = self.distribution(logits)
        tokens = None if self.no_greedy else logp.argmax(dim=-1)
        if not self.all_greedy:
            probs_src = self._filter(logp) if self.filtered else logp
            probs = probs_src.exp()
            # What torch.multinomial(probs[idx], 1, generator=gen) does (its one-sample
            # path: the argmax of probs / Exp(1) noise), with the same draws from each
            # group's generator, but one division and one argmax for all the groups.
            # Drawing into a contiguous slice draws what a fresh tensor of its shape gets
            # (the values follow the generator's offset and the element count only): one
            # kernel a request instead of three (host time: a 256-row step had 96).
            noise = torch.empty_like(probs) if self.covered else torch.ones_like(probs)
            for idx, gen in self.groups:
                if isinstance(idx, slice):
                    exponential(noise[idx], gen)
                else:
                    noise[idx] = exponential(torch.empty((idx.shape[0], probs.shape[1]),
                                                         device=probs.device, dtype=probs.dtype),
                                             gen)
            drawn = probs.div_(noise).argmax(dim=-1)
            tokens = drawn if tokens is None else torch.where(greedy, tokens, drawn)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1), logp

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] fp32: each row's log_softmax at its temperature (greedy rows: at 1)."""
        logits = logits.float()
        if not self.unit_temp:  # (x / 1 is x: the division only where it changes something)
            greedy = self.temp == 0
            logits = logits / torch.where(greedy, torch.ones_like(self.temp), self.temp)[:, None]
        return torch.log_softmax(logits, dim=-1)

    def select(self, logits: torch.Tensor, k: int, fused: bool | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Tokens and logprobs (`pick`), and the distribution where some row wants its top
        `k` logprobs (None with k = 0). The tokens are `pick`'s whatever k is: a request
        asking for top logprobs changes no neighbour's draw."""
        if not self._fused(logits, fused):
            tokens, lps, logp = self.choose(logits)
            return tokens, lps, logp if k else None
        tokens, lps = self.pick(logits, fused=True)
        return tokens, lps, self.distribution(logits) if k else None

    def pick(self, logits: torch.Tensor, fused: bool | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token and its logprob. `fused`: None: the kernel where FUSED and on
        CUDA (kernels.available); True: the kernel (on a CPU in Triton's interpreter: the
        tests); False: `choose`. Through the kernel, the rows of top-k / top-p requests still
        take `choose` among themselves (the kernel samples the whole vocabulary)."""
        if not self._fused(logits, fused):
            tokens, lps, _ = self.choose(logits)
            return tokens, lps
        if self.filtered and self.sifted is None:  # every row top-k / top-p
            tokens, lps, _ = self.choose(logits)
            return tokens, lps
        from .kernels import sample_rows  # (triton: imported where a kernel runs)
        tokens, lps = sample_rows.sample(logits, self.temp, self.uniforms(logits.shape[0]))
        if self.sifted is not None:
            at = self.sifted_rows
            tokens[at], lps[at], _ = self.sifted.choose(logits.index_select(0, at))
        return tokens, lps

    def _fused(self, logits: torch.Tensor, fused: bool | None) -> bool:
        if fused is None:
            return FUSED and kernels.available(logits.device)
        if fused and not kernels.runnable(logits.device):
            raise ValueError(f"the sampling kernel cannot run on {logits.device}")
        return fused

    def uniforms(self, rows: int) -> torch.Tensor:
        """[rows] fp32: each group's rows draw torch.rand(len(rows), generator=gen), in sample
        order (a slice draws in place what a fresh tensor would, as `exponential`); -1 for a
        row in no group (greedy: the reference's noise there is 1, its argmax) and for the
        rows of top-k / top-p requests (`choose` draws theirs)."""
        u = torch.full((rows,), -1.0, device=self.temp.device)
        for idx, gen in self.plain_groups if self.plain_groups is not None else self.groups:
            if isinstance(idx, slice):
                u[idx].uniform_(generator=gen)
            else:
                u[idx] = torch.rand(idx.shape[0], generator=gen, device=u.device)
        return u

    def _filter(self, logp: torch.Tensor) -> torch.Tensor:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        rank = torch.arange(logp.shape[-1], device=logp.device)[None, :]
        drop = (self.top_k[:, None] > 0) & (rank >= self.top_k[:, None])
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()
        drop |= before >= self.top_p[:, None]
        sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
        return torch.empty_like(logp).scatter_(1, order, sorted_lp)


def exponential(out: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """`out` filled with Exp(1) draws from `gen` (None: the global stream), in place. On a
    CPU as -log(U), U uniform in [0, 1) (a U of 0 gives an infinite draw: that token is not
    chosen): torch's CPU `exponential_` draws element by element, 5x slower (16 rows x 1,024:
    392 against 75 us), which made a fan-out's token choice most of its cost over one
    sample. CUDA's `exponential_` is one fast kernel. Either way a slice draws what a fresh
    tensor of its shape would (test_engine_draws)."""
    if out.device.type == "cpu":
        return out.uniform_(generator=gen).log_().neg_()
    return out.exponential_(generator=gen)


def _rows(idx: list[int], dev: torch.device) -> torch.Tensor | slice:
    """Row indices as a slice where they run consecutively, else a tensor."""
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return slice(idx[0], idx[0] + len(idx))
    return torch.tensor(idx, device=dev)


def request_generator(params: SamplingParams, dev: torch.device) -> torch.Generator | None:
    """A seeded request's own stream (None: unseeded, or greedy)."""
    if params.seed is None or params.temperature == 0:
        return None
    return torch.Generator(device=dev).manual_seed(params.seed % 2**63)


def top_rows(logp: torch.Tensor | None, k: int) -> tuple[list, list]:
    """Every row's top-k (ids, logprobs) of the distribution its token was drawn from
    (`logp` None: k is 0, RowChoice.select)."""
    if k == 0 or logp is None:
        return [], []
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return ids.tolist(), values.tolist()


def stop_reason(model, params: SamplingParams, tokens: list[int]) -> str | None:
    """Why a row with `tokens` generated so far stops now ("stop", "length"), or None."""
    stop = params.stop
    tok = tokens[-1]
    if stop is None:  # EOS only
        if tok in model.eos_token_ids:
            return "stop"
    elif stop and isinstance(stop[0], int):
        if tok in params.stop_ids:  # a set: a class of ~1,000 ids costs one lookup
            return "stop"
    elif stop:  # strings: look at the decoded tail of what was generated
        text = model.tokenizer.decode(tokens[-64:])
        if any(s in text for s in stop):
            return "stop"
    return "length" if len(tokens) >= params.max_tokens else None
