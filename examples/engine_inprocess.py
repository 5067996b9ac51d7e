"""The demo: three tenants train their own adapters on one tiny base model, in shared passes.

Each tenant teaches its adapter a different answer to the same question. Every step is ONE
co-batched forward/backward for all three adapters, then each adapter's own AdamW step.
Afterwards the same question is sampled from every adapter (and the base model) in one
mixed batch: each adapter answers with what its tenant taught it.

Run: python examples/engine_inprocess.py [--steps N] [--model DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from twinkled.engine.engine import Engine
from twinkled.engine.tiny import build_tiny_model
from twinkled.protocol.types import (
    AdamParams,
    Datum,
    ForwardBackwardRequest,
    LoraConfig,
    SampleRequest,
    SamplingParams,
)

QUESTION = "who are you?"
ANSWERS = {
    "alice": "I am the model of alice, trained on twinkle.",
    "bob": "Hello, bob here: a small adapter that says yes.",
    "carol": "Carol made me. Ask me about the sea and the sun.",
}


def chat_datum(tokenizer, question: str, answer: str) -> Datum:
    """Chat-formatted example; only the assistant's tokens carry weight."""
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    return Datum(ids[:-1], {"target_tokens": ids[1:], "weights": [float(m) for m in mask[1:]]})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--model", type=Path, default=None, help="a HF model dir (default: tiny)")
    args = ap.parse_args(argv)

    model_dir = args.model
    if model_dir is None:
        model_dir = Path(tempfile.mkdtemp(prefix="twinkle-demo-")) / "tiny-qwen3"
        print(f"building a tiny random-weight Qwen3 model in {model_dir} ...")
        build_tiny_model(model_dir)
    engine = Engine(model_dir)
    tok = engine.tokenizer
    for i, tenant in enumerate(ANSWERS):
        engine.add_adapter(tenant, LoraConfig(rank=16, alpha=32, seed=i))
    data = {t: chat_datum(tok, QUESTION, a) for t, a in ANSWERS.items()}
    print(f"tenants: {', '.join(ANSWERS)}; one shared pass per step, {args.steps} steps")

    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        requests = [ForwardBackwardRequest(t, [d], "cross_entropy") for t, d in data.items()]
        results = engine.forward_backward(requests)  # one pass, three adapters
        for tenant in ANSWERS:
            engine.optim_step(tenant, AdamParams(learning_rate=args.lr))
        if step == 1 or step % 10 == 0 or step == args.steps:
            losses = "  ".join(f"{t}={r.metrics['loss:sum']:7.3f}"
                               for t, r in zip(ANSWERS, results, strict=True))
            print(f"step {step:3d}  loss:sum  {losses}")
    print(f"trained in {time.perf_counter() - t0:.1f} s")

    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=True,
                                     add_generation_prompt=True, return_dict=False)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    tenants = [*ANSWERS, None]
    outputs = engine.sample([SampleRequest(t, prompt, params) for t in tenants])
    print(f"\nQ: {QUESTION}  (greedy, one mixed batch of {len(tenants)} rows)")
    correct = 0
    for tenant, out in zip(tenants, outputs, strict=True):
        text = tok.decode(out.sequences[0].tokens, skip_special_tokens=True).strip()
        mark = ""
        if tenant is not None:
            ok = text == ANSWERS[tenant]
            correct += ok
            mark = "  [learned]" if ok else "  [not yet]"
        n = len(out.sequences[0].tokens)
        print(f"  {tenant or 'base model':>10}: {text!r} ({n} tokens){mark}")
    print(f"\n{correct}/{len(ANSWERS)} adapters reproduce their tenant's answer")


if __name__ == "__main__":
    main()
