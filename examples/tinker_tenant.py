"""A tenant's training script, written for the unmodified `tinker` SDK: only base_url changes.

It teaches a LoRA adapter to answer a question with a given sentence, with either
supervised cross entropy or an RL-style loss (ppo with a positive advantage on the
sentence, its sampler logprobs from a forward pass), prints the loss curve, then samples.

    python examples/tinker_tenant.py --base-url http://127.0.0.1:8000 --api-key tml-... \
        --base-model tiny-qwen3 --rank 8 --loss cross_entropy --answer "I am alice."
"""

from __future__ import annotations

import argparse

import tinker
from tinker import types


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--base-model", required=True)
    ap.add_argument("--name", default="tenant")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--loss", default="cross_entropy", choices=["cross_entropy", "ppo"])
    ap.add_argument("--answer", default="I am a small adapter.")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--seed", type=int, default=0, help="LoRA init seed (reproducible runs)")
    args = ap.parse_args()

    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    training = service.create_lora_training_client(base_model=args.base_model,
                                                    rank=args.rank, seed=args.seed).result()
    tok = training.get_tokenizer()
    question = tok.apply_chat_template([{"role": "user", "content": "who are you?"}],
                                       tokenize=True, add_generation_prompt=True,
                                       return_dict=False)
    answer = tok(args.answer).input_ids + [tok.eos_token_id]
    full = question + answer
    weights = [0.0] * (len(question) - 1) + [1.0] * len(answer)
    inputs = {"target_tokens": full[1:]}
    if args.loss == "cross_entropy":
        inputs["weights"] = weights
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)

    curve = []
    for _ in range(args.steps):
        batch = datum
        if args.loss == "ppo":
            # The "sampler" logprobs of this exact sequence, and advantage 1 on the answer.
            fwd = training.forward([datum], "cross_entropy").result()
            batch = types.Datum(model_input=datum.model_input, loss_fn_inputs={
                **inputs, "logprobs": fwd.loss_fn_outputs[0]["logprobs"].tolist(),
                "advantages": weights})
        out = training.forward_backward([batch], args.loss).result()
        # Torch's AdamW defaults (beta2 0.999, eps 1e-8) and clipping at 1: without them the
        # summed loss of one short sequence spikes now and then near convergence.
        training.optim_step(types.AdamParams(learning_rate=args.lr, beta2=0.999, eps=1e-8,
                                             grad_clip_norm=1.0)).result()
        # The same yardstick for both losses: the answer's log-likelihood (rises to 0).
        lps = out.loss_fn_outputs[0]["logprobs"].tolist()
        curve.append(sum(lp * w for lp, w in zip(lps, weights, strict=True)))
    marks = "  ".join(f"{i}:{curve[i]:.1f}" for i in range(0, args.steps, max(1, args.steps // 8)))
    print(f"[{args.name}] rank {args.rank}, loss {args.loss}; log p(answer) by step  {marks}  "
          f"{args.steps - 1}:{curve[-1]:.2f}")

    sampler = training.save_weights_and_get_sampling_client().result()
    result = sampler.sample(types.ModelInput.from_ints(question), num_samples=1,
                            sampling_params=types.SamplingParams(max_tokens=24,
                                                                 temperature=0.0)).result()
    text = tok.decode(result.sequences[0].tokens, skip_special_tokens=True)
    print(f"[{args.name}] asked 'who are you?', its adapter answers: {text!r}")
    service.close("success")


if __name__ == "__main__":
    main()
