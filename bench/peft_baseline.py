"""The plain baseline the benches compare against: transformers + peft, one LoRA adapter per
tenant, the tenants trained one at a time (forward + backward + AdamW step each).

A model too big for one card is spread over `gpus` cards with `device_map="auto"` (layers
placed card after card, one card computing at a time), the way plain peft trains a 32B or
70B model on a multi-GPU box."""

from __future__ import annotations

import time
from pathlib import Path

DENSE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_run(model_dir: Path, tenants: int, seq: int, steps: int, rank: int,
             targets: list[str], parameters: list[str] | None = None, gpus: int = 1,
             checkpointing: bool = False) -> tuple[float, list[float]]:
    """tokens/s over `steps` timed rounds (after one warm-up round), and each card's peak
    GiB. `parameters`: peft's `target_parameters` (MoE experts)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if gpus == 1:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, device_map="auto",
            max_memory={i: "70GiB" for i in range(gpus)})
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                     **({"target_parameters": parameters} if parameters else {}))
    pm = get_peft_model(model, cfg, adapter_name="t0")
    for i in range(1, tenants):
        pm.add_adapter(f"t{i}", cfg)
    opts = {f"t{i}": torch.optim.AdamW([p for n, p in pm.named_parameters() if f".t{i}." in n],
                                       lr=1e-4) for i in range(tenants)}
    first = next(pm.parameters()).device
    ids = torch.randint(0, 1000, (1, seq), device=first)
    for i in range(gpus):
        torch.cuda.reset_peak_memory_stats(i)
    t0 = None
    for s in range(steps + 1):
        if s == 1:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        for i in range(tenants):
            pm.set_adapter(f"t{i}")
            pm(input_ids=ids, labels=ids).loss.backward()
            opts[f"t{i}"].step()
            opts[f"t{i}"].zero_grad()
    torch.cuda.synchronize()
    tps = steps * tenants * seq / (time.perf_counter() - t0)
    return tps, [torch.cuda.max_memory_allocated(i) / 2**30 for i in range(gpus)]
