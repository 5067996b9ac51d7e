"""Where the sampler's and the trainer's logprobs part (`bench_gap.py --paths`).

The sequences the running batch sampled are scored again, teacher-forced, through each
path the two sides take, one difference at a time:

- the sampler's decode: the logprobs it reported, token by token over the KV pages;
- the sampler's prefill of prompt + completion in one pass, the running batch's LoRA rows
  and attention (kernels where they run): against the decode, what decoding token by
  token and reading keys and values back from the bf16 pages changes;
- the same prefill with the kernels off (masked LoRA stack, gathered pages + SDPA);
- the trainer, one sequence a pass (what the daemon's check runs), a request's samples in
  one pass (as an RL step packs them: the trainer against itself), with gradients (the
  pass whose logprobs an RL loss reads), padded rows, and the chunked head;
- with `--reference`, an fp32 copy of the model and adapters (the same bf16-rounded
  weights): how far each path is from exact arithmetic.

Each row gives the mean and largest |difference| per token from the trainer's check and
from the sampler's decode, and the mean signed difference (a bias would show there; bf16
rounding noise averages out).
"""

from __future__ import annotations

import torch

from twinkled.engine import kernels as kern
from twinkled.engine.engine import Engine
from twinkled.engine.lora_rows import row_lora
from twinkled.engine.prefix_cache import prefill
from twinkled.engine.running import RunningBatch
from twinkled.protocol.types import Datum, ForwardBackwardRequest, SampleRequest

# (adapter id, prompt, completion tokens, the sampler's logprobs of them)
Seq = tuple[str | None, list[int], list[int], list[float]]
DECODE = "sampler: decode (reported)"
CHECK = "trainer: a sequence a pass (the check)"


def sequences(reqs: list[SampleRequest], results) -> list[list[Seq]]:
    """Each request's sampled sequences."""
    return [[(req.adapter_id, req.prompt, s.tokens, s.logprobs) for s in res.sequences]
            for req, res in zip(reqs, results, strict=True)]


def trainer(eng: Engine, groups: list[list[Seq]], together: bool, grad: bool = False
            ) -> torch.Tensor:
    """The training forward's logprobs of every completion token: one sequence a pass, or
    (`together`) each request's sequences in one pass; `grad`: through forward_backward
    (what an RL step's loss reads; the gradients are dropped)."""
    out = []
    for group in groups:
        parts = [group] if together else [[s] for s in group]
        for part in parts:
            data = [Datum([*p, *t][:-1], {"target_tokens": [*p, *t][1:]})
                    for _, p, t, _ in part]
            req = ForwardBackwardRequest(part[0][0], data)
            res = (eng.forward_backward if grad else eng.forward)([req])[0]
            if grad and req.adapter_id is not None:
                eng.zero_grad(req.adapter_id)
            out += [o["logprobs"][len(p) - 1:].double().cpu()
                    for o, (_, p, _, _) in zip(res.outputs, part, strict=True)]
    return torch.cat(out)


@torch.no_grad()
def sampler_prefill(eng: Engine, groups: list[list[Seq]], kernels: bool) -> torch.Tensor:
    """Prompt + completion prefilled in one pass through the running batch's paths."""
    model = eng.model
    batch = RunningBatch(model, rows=1, kernels=kernels)
    out = []
    for aid, p, t, _ in (s for g in groups for s in g):
        seq = [*p, *t]
        adapter = None if aid is None else eng.pool.get(aid)
        if adapter is not None:
            batch.stack.acquire(adapter)
        lora = row_lora(batch.stack, [adapter], kernels)
        pages = batch.pool.allocate(batch.pool.pages_for(len(seq)))
        hidden, _ = prefill(model, batch.pool, lora, [seq], [0], [pages])
        logp = torch.log_softmax(model.logits(hidden, lora)[0].float(), -1)
        target = torch.tensor(seq[1:], device=logp.device)
        out.append(logp[:-1].gather(1, target[:, None])[len(p) - 1:, 0].double().cpu())
        batch.pool.release(pages)
        if adapter is not None:
            batch.stack.release(adapter)
    return torch.cat(out)


def reference_engine(eng: Engine, model_dir, adapters: list[str]) -> Engine:
    """An fp32 engine on the same checkpoint with `adapters` holding the bf16-rounded
    weights the bf16 engine computes with."""
    ref = Engine(model_dir, dtype=torch.float32, device=eng.model.device)
    for name in adapters:
        a = eng.pool.get(name)
        ref.add_adapter(name, a.config)
        b = ref.pool.get(name)
        with torch.no_grad():
            for dst, src in zip(b.bank.tensors(b.slot, "w"), a.bank.tensors(a.slot, "w"),
                                strict=True):
                dst.copy_(src.to(eng.model.dtype).float())
        b.bank.changed(b.slot)
    return ref


def paths(eng: Engine, groups: list[list[Seq]], ref: Engine | None = None
          ) -> dict[str, torch.Tensor]:
    """Every path's logprobs of the sampled tokens, in one order."""
    found = {DECODE: torch.tensor(
        [x for g in groups for s in g for x in s[3]], dtype=torch.float64)}
    on = kern.available(eng.model.device)
    found["sampler: prefill of prompt + completion" + (", kernels" if on else "")] = (
        sampler_prefill(eng, groups, on))
    if on:
        found["sampler: prefill, kernels off"] = sampler_prefill(eng, groups, False)
    found[CHECK] = trainer(eng, groups, False)
    found["trainer: a request's samples in one pass"] = trainer(eng, groups, True)
    found["trainer: with gradients (forward_backward)"] = trainer(eng, groups, False, True)
    packed, head = eng.packed, eng.model.head
    try:
        eng.packed = False
        found["trainer: padded rows"] = trainer(eng, groups, False)
        eng.packed, eng.model.head = packed, "chunked"
        found["trainer: chunked head"] = trainer(eng, groups, False)
    finally:
        eng.packed, eng.model.head = packed, head
    if ref is not None:
        found["fp32 reference"] = trainer(ref, groups, False)
    return found


def table(found: dict[str, torch.Tensor]) -> str:
    """Markdown: each path against the trainer's check, the sampler and the reference."""
    check, sampler = found[CHECK], found[DECODE]
    ref = found.get("fp32 reference")
    cols = ["mean \\|Δ\\| vs trainer check", "max", "mean signed Δ",
            "mean \\|Δ\\| vs sampler decode"] + (["mean \\|Δ\\| vs fp32"] if ref is not None else [])
    lines = ["| path | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, lp in found.items():
        d = lp - check
        row = (f"| {name} | {d.abs().mean():.3g} | {d.abs().max():.3g} | {d.mean():+.2g} | "
               f"{(lp - sampler).abs().mean():.3g} |")
        if ref is not None:
            row += f" {(lp - ref).abs().mean():.3g} |"
        lines.append(row)
    return "\n".join(lines) + "\n"
