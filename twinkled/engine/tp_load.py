"""Reading a tensor-parallel rank's share of a base model (the split is tp.py's ShardPlan).

A dense model's slices are read straight from the safetensors files, never whole
(`load_sharded`). A mixture-of-experts model is read whole on the host, because its files
hold the experts one by one and transformers fuses them as it loads (gpt-oss's may be
MXFP4, Qwen3.5's are nested under a multimodal model's names: read whole too); each rank
then keeps its slices of the dense modules and its share of the experts (`shard_loaded`,
moe.py's `shard_experts`) before anything goes to the device.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from twinkled.protocol.types import EngineInputError

from .tp import ShardPlan
from .tp_linear import PER_V_HEAD


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        wmap = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / f for name, f in wmap.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise EngineInputError("model", f"{model_dir} has no safetensors weights (tensor "
                               "parallelism reads each rank's slice from them)")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def load_sharded(model_dir: Path, config, dtype: torch.dtype, device: torch.device,
                 plan: ShardPlan):
    """The HF model with only this rank's slices, read straight from the files."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    files = _weight_files(model_dir)
    handles: dict[Path, object] = {}
    for name in [n for n, _ in hf.named_parameters()]:
        if name not in files:
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # tied below
            raise EngineInputError("model", f"{model_dir}: no tensor {name!r} in its files")
        f = handles.get(files[name])
        if f is None:
            f = handles[files[name]] = safe_open(files[name], "pt", device="cpu")
        owner, leaf = name.rsplit(".", 1)
        module = hf.get_submodule(owner)
        t = _share(f.get_slice(name), module, owner, leaf, plan)
        setattr(module, leaf, torch.nn.Parameter(t.to(device=device, dtype=dtype),
                                                 requires_grad=False))
    if config.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    # Buffers (the rotary frequencies) are computed, not stored: build them on the device.
    with torch.device(device):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if left:
        raise EngineInputError("model", f"{model_dir}: tensors left unloaded: {left[:3]}")
    return hf.eval().requires_grad_(False)



def shard_loaded(hf, plan: ShardPlan) -> None:
    """Keep only this rank's slices of a model read whole (on the host): the dense
    modules and the vocabulary as `load_sharded` reads them; the experts are moe.py's."""
    for name, param in list(hf.named_parameters()):
        owner, leaf = name.rsplit(".", 1)
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue  # tied below
        module = hf.get_submodule(owner)
        t = _share(param.data, module, owner, leaf, plan)
        if t is not param.data:
            setattr(module, leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
    if hf.config.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    if plan.linear is not None:  # its head counts and widths now the rank's
        for layer in hf.model.layers:
            if hasattr(layer, "linear_attn"):
                plan.linear.localize(layer.linear_attn)


def _share(source, module, owner: str, leaf: str, plan: ShardPlan):
    """This rank's part of one parameter of `module`, indexed out of `source` (a
    safetensors slice or a tensor); `source` itself when the rank holds it whole."""
    rows = cols = None
    if isinstance(module, torch.nn.Linear):
        rows, cols = plan.slices(owner, (module.in_features, module.out_features))
    elif isinstance(module, torch.nn.Embedding) and plan.vocab_split:
        rows = plan.vocab_rows
    elif leaf == "sinks":  # gpt-oss: one logit per attention head, kept with its head
        return source[plan.head_slice()]
    elif isinstance(module, torch.nn.Conv1d) and plan.linear is not None:  # Gated DeltaNet's
        return source[plan.linear.rows(plan.rank)]  # channels: in_proj_qkv's rows
    elif leaf in PER_V_HEAD and plan.linear is not None:
        return source[plan.linear.v_heads(plan.rank)]
    if leaf == "bias":
        t = source[rows] if rows is not None else source[:]
        if cols is not None and plan.rank != 0:
            t = torch.zeros_like(t)  # a row-parallel bias is added once, after the sum
        return t
    if rows is None and cols is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    return source[rows] if rows is not None else source[:, cols]
