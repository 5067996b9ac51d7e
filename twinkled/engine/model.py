"""The base model: loaded once from a Hugging Face directory, frozen, run by our own forward.

We load weights and submodules (norms, rotary embedding, linears) with `transformers` but
run the decoder loop ourselves. That keeps the multi-LoRA deltas explicit at every linear,
gives sampling a plain preallocated KV cache, and insulates the hot path from the
attention/cache API, which changes between transformers releases. The architectures are
the Llama family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norms), and its
mixture-of-experts kin Qwen3-MoE and Mixtral, whose sparse MLPs run in moe.py; and Qwen3.5,
whose hybrid layers (linear attention in three of every four) run in qwen35.py.
"""

from __future__ import annotations

import functools
import gc
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from twinkled.protocol.types import MLP_MODULES, EngineInputError

from . import chunked_logprobs, deepstack, fused_ops, gpt_oss, mla, mxfp4, qwen35, sparse, vision
from .fused_ops import Fused, Joint
from .kv_cache import KVCache
from .kv_pages import PagedView
from .long_context import extend_context
from .lora import LoraBatch
from .losses import target_logprobs
from .moe import MOE_ARCHS, bank_tokens, shard_experts
from .moe_parallel import ExpertSplit
from .packed import PackedLora, Packing
from .recompute import Recompute
from .tp import NoSplit

SUPPORTED_ARCHS = tuple(dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", *MOE_ARCHS,
                                       *qwen35.ARCHS, *gpt_oss.ARCHS, *vision.ARCHS)))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _without_gc(fn):
    """`fn` with the cyclic garbage collector paused (back on after, if it was on). A model's
    first build imports transformers' modeling stack (torch._dynamo, torch.distributed.tensor,
    scipy.optimize, ...) and makes hundreds of thousands of objects that all live on; the
    collections their allocations trigger meanwhile traverse the whole growing heap and free
    nothing (measured: ~0.4 s of the ~5.5 s of CPU a CPU worker takes to start)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return run


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise EngineInputError("dtype", f"must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class BaseModel:
    @_without_gc
    def __init__(self, model_dir: str | Path, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", tp=None,
                 experts: ExpertSplit | None = None, rope_scaling: dict | None = None,
                 max_seq_len: int | None = None):
        """`tp`: this rank's TensorParallel (tp.py); `experts`: this rank's share of an MoE
        model's experts (expert parallelism, moe_parallel.py). `rope_scaling`/`max_seq_len`:
        rows longer than the config (long_context.py)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise EngineInputError("model", f"{model_dir} is not a Hugging Face model directory")
        config = mla.kimi_config(model_dir) or AutoConfig.from_pretrained(model_dir)
        if config.model_type not in SUPPORTED_ARCHS:
            raise EngineInputError(
                "model", f"architecture {config.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHS)}")
        sinks = config.model_type in gpt_oss.ARCHS  # (gpt-oss: windows of its own, gpt_oss.py)
        sliding = (getattr(config, "use_sliding_window", False)
                   or "sliding_attention" in (getattr(config, "layer_types", None) or ())
                   or (config.model_type == "mixtral" and getattr(config, "sliding_window", None)))
        if sliding and not sinks:
            raise EngineInputError("model", "sliding-window attention is not supported")
        loaded = config  # what from_pretrained builds from (a Qwen3.5 checkpoint's nests)
        hybrid = config.model_type in qwen35.ARCHS
        if hybrid:
            config = qwen35.text_config(config)  # (the nested object itself: scaled below)
        vl = vision.takes_images(model_dir)  # (Qwen3.5: with its image processor's files)
        if vl:  # a VL checkpoint: the text stack's config
            vision.check(tp)
            config = loaded.get_text_config()
        # Before the model is built: its rotary module computes the scaled frequencies.
        self.max_seq_len = extend_context(config, rope_scaling, max_seq_len)
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.dtype == torch.float32:
            # cuDNN's convolutions (a VL tower's patch embedding) default to TF32 on Ampere
            # and later (~1e-3 relative): a float32 model is one asked to compute in float32
            torch.backends.cudnn.allow_tf32 = False
        if self.device.type == "cuda":
            # SDPA's cuDNN backend, first choice on H100/H200 since torch 2.11: it failed
            # with CUDNN_STATUS_INTERNAL_ERROR on DeepSeek's latent attention (key width 192,
            # value 128) decoding 256 rows, and upstream it gives NaN query gradients with a
            # mask at lengths of 64 mod 128 (pytorch#196678). Flash / memory-efficient /
            # math instead: the kernels the CPU-checked paths were measured with.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.dir = model_dir
        self.config = config
        # Tensor parallelism (tp.py): `tp` is this rank's TensorParallel; `shard` says
        # which slice of each module it holds. NoSplit: the whole model, no collectives.
        self.tp, self.shard = NoSplit(), None
        self.moe = {}
        self.vision = None  # a VL checkpoint's frozen vision tower (vision.py)
        if tp is not None and tp.size > 1:
            from .tp import ShardPlan

            self.tp, self.shard = tp, ShardPlan(config, tp)
        if self.shard is not None and config.model_type not in MOE_ARCHS and not (
                sinks or hybrid):
            from .tp_load import load_sharded

            self.hf = load_sharded(model_dir, config, self.dtype, self.device, self.shard)
        else:
            # Read whole on the host; an MoE model's files hold its experts one by one, and
            # transformers fuses them as it loads (gpt-oss's may be MXFP4 too).
            if mxfp4.quantized(loaded):  # gpt-oss as released: experts in MXFP4
                self.hf = mxfp4.load_dequantized(model_dir, loaded, self.dtype)
            else:
                auto = vision.auto_class(model_dir) or AutoModelForCausalLM
                self.hf = auto.from_pretrained(model_dir, config=loaded, dtype=self.dtype)
            if vl:  # the tower beside the text stack
                self.hf, self.vision = vision.split(self.hf, loaded, self.device)
            if self.shard is not None:  # attention split as for a dense model
                from .tp_load import shard_loaded

                shard_loaded(self.hf, self.shard)
                # ... and the experts over the same group, as --ep splits them
                experts = ExpertSplit(tp.rank, tp.size, tp.group)
            # Sparse MLP layers (moe.py); the experts of other ranks are dropped before the
            # copy to the device.
            self.moe = sparse.sparse_blocks(config.model_type, config, list(self.hf.model.layers),
                                  experts)
            if experts is not None:
                shard_experts(self.moe, experts)
            self.hf.to(self.device).eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

        self.decoder = self.hf.model
        self.layers = list(self.decoder.layers)
        self.lm_head = self.hf.lm_head
        attn = next(la.self_attn for la in self.layers if hasattr(la, "self_attn"))
        self.head_dim = getattr(attn, "qk_head_dim", None) or attn.head_dim  # (MLA: qk's)
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        if self.shard is not None:  # this rank's heads
            self.n_heads, self.n_kv = self.shard.local_heads, self.shard.local_kv
        self.scaling = getattr(attn, "scaling", self.head_dim**-0.5)
        self.vocab_size = self.lm_head.out_features  # whole, when this rank holds a slice
        self.eos_token_ids = _eos_ids(config, self.tokenizer)
        # Training's logprobs: "chunked" a chunk of tokens at a time from the hidden
        # states, "full" through the whole logits (the reference path), "auto": chunked
        # where the whole logits would be big (chunked_logprobs.py).
        self.head = "auto"
        # q/k/v and gate/up adapters' A matmuls one per group (lora_fused.py), and in the
        # sampler's row kernels one launch pair per group (lora_decode.apply_group); False:
        # one per module (the reference path).
        self.fuse_lora = True
        # Fused kernels of the layer (fused_ops.py), one lever each; Fused.off(): the
        # reference path, HF's modules op by op. The kernels are liger-kernel's (CUDA only);
        # elsewhere the levers keep the fused structure with eager math.
        self.fused = Fused()
        self.kernels = fused_ops.liger_usable(self.device)
        # Qwen3.5's hybrid layers (qwen35.py); None: every layer is the Llama family's.
        self.hybrid = qwen35.HybridLayers(self) if hybrid else None
        # gpt-oss's attention (sinks, sliding windows; gpt_oss.py); None: plain attention.
        self.sinks = gpt_oss.SinkAttention(self) if sinks else None
        self.rotary = self.decoder.rotary_emb if not sinks else self.sinks.rotary
        # DeepSeek-V3's multi-head latent attention (mla.py); None: q/k/v/o attention.
        self.latent = mla.LatentAttention(self) if config.model_type in mla.ARCHS else None
        # Layers whose keys and values the sampler's pages hold (Qwen3.5: the full ones).
        self.kv_layers = len(self.layers) if self.hybrid is None else len(self.hybrid.kv)
        # What a token keeps per such layer: (heads, key width, value width); MLA: its latent.
        self.kv_shape = ((self.n_kv, self.head_dim, self.head_dim) if self.latent is None
                         else self.latent.kv_shape)
        # q/k/v and gate/up weights one tensor each (after loading, sharding and the move
        # to the device, so every rank concatenates its own shards)
        self.joints = fused_ops.layer_joints(
            self.layers, self.moe, plain_attention=self.hybrid is None and self.latent is None)
        self.recompute = Recompute(config.to_dict(), self.dtype, self.device, self.tp.size,
                                   self.tp.group)

        # Every linear a LoRA may target: "model.layers.3.mlp.up_proj" -> (in, out).
        self.targets: dict[str, tuple[int, int]] = {}
        self.layer_keys: list[dict[str, str]] = []
        for i, layer in enumerate(self.layers):
            keys = (qwen35.layer_keys(i, layer) if self.latent is None
                    else mla.layer_keys(i, layer.self_attn))
            shared = ".shared_experts" if hasattr(layer.mlp, "shared_experts") else ""
            for name in () if i in self.moe and not shared else MLP_MODULES:
                keys[name] = f"model.layers.{i}.mlp{shared}.{name}"
            self.layer_keys.append(keys)
        modules = dict(self.hf.named_modules())
        for keys in self.layer_keys:
            for key in keys.values():
                m = modules[key]
                self.targets[key] = (m.in_features, m.out_features)
        self.targets["lm_head"] = (self.lm_head.in_features, self.lm_head.out_features)
        for block in self.moe.values():  # expert parameters: key -> (in, out, experts)
            self.targets.update(block.targets())
        if self.hybrid is not None:  # (Qwen3-Next's MLP linears: qwen35_moe.py)
            qwen35.trim_targets(config, self.targets)
            self.hybrid.warm()  # fla's autotuning now, not in a tenant's first request
        if self.shard is not None:
            self.shard.full_shapes = self.targets

    # -- the forward pass -------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                lora: LoraBatch | PackedLora | None = None, cache: KVCache | None = None,
                mask: torch.Tensor | None = None, packing: Packing | None = None,
                images: vision.Images | None = None) -> torch.Tensor:
        """Final hidden states [B, S, H]. Without `mask`, attention is causal within the row
        (right padding needs no mask: real tokens never attend to later pads). With
        `packing`, the one row [1, T] holds several sequences end to end (packed.py). With
        `images` (a VL model) their embeddings replace the placeholders' (Qwen3-VL's DeepStack
        features add to the first layers' outputs there) and `positions` are multimodal
        RoPE's [3, B, S] (mrope.py)."""
        if self.shard is not None and self.shard.vocab_split:
            h = self.shard.embed(self.decoder.embed_tokens.weight, input_ids)
        else:
            h = self.decoder.embed_tokens(input_ids)
        feats = None
        if images is not None:  # [image tokens, 1 + DeepStack levels, H] (deepstack.py)
            feats = self.vision.features(images)
            h = self.vision.splice(h, images.index, feats[:, 0])
        if hasattr(self.decoder.rotary_emb, "mrope_section") and positions.dim() == 2:
            # Qwen3.5's rotary is multimodal (t, h, w sections); text has the same position in
            # all three, and transformers before 5.2x indexes a 3-D tensor without expanding
            positions = positions.expand(3, *positions.shape)
        cos, sin = self.rotary(h, positions)
        # Recompute per layer (checkpointing): the backward keeps only each layer's input
        # and runs the layer again; recompute.py says when (a step that would not fit).
        tokens = input_ids.numel() if packing is None else packing.memory_tokens()
        again = torch.is_grad_enabled() and self.recompute.wanted(tokens)
        banks = bank_tokens(lora, h.shape[1]) if self.moe else []
        for i, layer in enumerate(self.layers):
            args = (i, layer, h, cos, sin, lora, cache, mask, packing, banks)
            h = checkpoint(self._layer, *args, use_reentrant=False) if again else self._layer(*args)
            if feats is not None and i + 1 < feats.shape[1]:  # Qwen3-VL's DeepStack
                h = deepstack.add(h, images.index, feats[:, i + 1])
        return self._norm(self.decoder.norm, h)

    def _layer(self, i, layer, h, cos, sin, lora, cache, mask, packing, banks) -> torch.Tensor:
        if self.hybrid is not None:
            return self.hybrid.layer(i, layer, h, cos, sin, lora, cache, mask, packing, banks)
        keys = self.layer_keys[i]
        x = self.tp.enter(self._norm(layer.input_layernorm, h))
        attend = self._attention if self.latent is None else self.latent.attention
        a = self.tp.leave(attend(i, layer.self_attn, x, cos, sin, keys, lora, cache, mask,
                                 packing))
        x, h = self._add_norm(layer.post_attention_layernorm, a, h)
        if i in self.moe:  # split experts bring their own pair of collectives (moe.py)
            y = self.moe[i](x, banks)
            if hasattr(layer.mlp, "shared_experts"):  # DeepSeek's (deepseek_moe.py)
                y = y + self.mlp(i, layer.mlp.shared_experts, x, keys, lora)
            return h + y
        return h + self.mlp(i, layer.mlp, x, keys, lora)

    def mlp(self, i: int, mlp, x: torch.Tensor, keys: dict[str, str], lora) -> torch.Tensor:
        """A dense layer's MLP (its LoRA deltas in) on the normed x."""
        x = self.tp.enter(x)
        (gate, up), joint = self.linears((mlp.gate_proj, mlp.up_proj),
                                          (keys["gate_proj"], keys["up_proj"]), x, lora,
                                          self.joints[i].get("mlp"))
        if self.fused.silu:
            act = fused_ops.silu_mul(gate, up, self.kernels, joint)
        else:
            act = mlp.act_fn(gate) * up
        return self.tp.leave(self.linear(mlp.down_proj, keys["down_proj"], act, lora))

    def _norm(self, module, x: torch.Tensor) -> torch.Tensor:
        if not self.fused.norm or self.hybrid is not None:  # (Qwen3.5's: x * (1 + w))
            return module(x)
        return fused_ops.rms_norm(x, module.weight, module.variance_epsilon, self.kernels)

    def _add_norm(self, module, x: torch.Tensor, residual: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add and the norm after it."""
        if not self.fused.norm:
            h = residual + x
            return module(h), h
        return fused_ops.add_rms_norm(x, residual, module.weight, module.variance_epsilon, self.kernels)

    def logits(self, hidden: torch.Tensor, lora: LoraBatch | PackedLora | None = None
               ) -> torch.Tensor:
        """Whole-vocabulary logits (sampling, prompt scores); gathered over the group
        when the vocabulary is split (tp.py), so not for training."""
        if self.shard is None or not self.shard.vocab_split:
            return self.linear(self.lm_head, "lm_head", hidden, lora)
        return self.shard.gather_vocab(self.linear(self.lm_head, "lm_head", hidden, lora))

    def target_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor,
                        lora: LoraBatch | PackedLora | None = None) -> torch.Tensor:
        """Each target's logprob [B, S(, K)] in fp32, differentiable. Under a vocabulary
        split each rank computes only its share of the logits."""
        if self.shard is None or not self.shard.vocab_split:
            if not chunked_logprobs.wanted(self.head, hidden.shape[:-1].numel(),
                                           self.lm_head.out_features, self.dtype):
                return target_logprobs(self.logits(hidden, lora), targets)
            segments = [] if lora is None else lora.segments("lm_head", hidden.shape[1])
            return chunked_logprobs.chunked_target_logprobs(
                hidden, targets, self.lm_head.weight, self.lm_head.bias, segments,
                None if lora is None else lora.anchor)
        local = self.linear(self.lm_head, "lm_head", self.tp.enter(hidden), lora)
        return self.shard.target_logprobs(local, targets)

    def _attention(self, i, attn, x, cos, sin, keys, lora, cache, mask, packing):
        B, S, _ = x.shape
        qkv, _ = self.linears((attn.q_proj, attn.k_proj, attn.v_proj),
                               (keys["q_proj"], keys["k_proj"], keys["v_proj"]), x, lora,
                               self.joints[i].get("attn"))
        q, k, v = (t.view(B, S, -1, self.head_dim) for t in qkv)
        if S == 1 and packing is None and self._prep(cache, cos):  # decode: one kernel for
            # the norms, the rotation and the store (a packed prefill of one token: not here)
            norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon,
                     attn.k_norm.variance_epsilon) if hasattr(attn, "q_norm") else None
            out = cache.attend_raw(i, q, k, v, cos, sin, norms, self.scaling).view(B, S, -1)
        else:
            if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before the rotation
                q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = fused_ops.rope(q, k, cos, sin, self.kernels and self.fused.rope)
            out = self.attend(i, q, k, v, cache, mask, packing)
        return self.linear(attn.o_proj, keys["o_proj"], out, lora)

    def _prep(self, cache, cos: torch.Tensor) -> bool:
        """A decode step's layer takes kernels/qk_prep.py (the `prep` lever): the paged
        kernel's view (`lengths`), plain attention (not gpt-oss's sinks, not a VL model's
        multimodal rotary) rotating whole heads."""
        return (self.fused.prep and isinstance(cache, PagedView) and cache.lengths is not None
                and self.sinks is None and self.vision is None
                and cos.shape[-1] == self.head_dim)

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, mask,
               packing) -> torch.Tensor:
        """Layer i's attention of rotated q [B, H, S, D] over k, v [B, Hkv, S, D] (stored in
        `cache` first) -> [B, S, H * D]."""
        if self.sinks is not None:
            return self.sinks.attend(i, q, k, v, self.scaling, cache, mask, packing)
        B, S = q.shape[0], q.shape[2]
        if S == 1 and getattr(cache, "fused", False):  # decode straight from the KV pages
            return cache.attend(i, q, k, v, self.scaling).transpose(1, 2).reshape(B, S, -1)
        if cache is not None:
            k, v = cache.write(i, k, v)
        if packing is not None:
            out = packing.attend(q, k, v, self.scaling, self.n_kv != self.n_heads)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None and cache is None,
                scale=self.scaling, enable_gqa=self.n_kv != self.n_heads)
        return out.transpose(1, 2).reshape(B, S, -1)

    @staticmethod
    def linear(module, key, x, lora):
        """`module` on x, with the LoRA deltas of `key` (the module's name) added."""
        y = F.linear(x, module.weight, module.bias)
        return y if lora is None else lora.apply(key, x, y)

    def linears(self, modules, keys, x, lora, joint: Joint | None = None
                 ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Linears that read the same x (q/k/v; gate/up), and the one output they are views
        of where the `gemm` lever ran them as one GEMM (`joint`, fused_ops.py). A LoRA batch
        that can (LoraBatch: `apply_shared`) runs the group's A matmuls as one
        (lora_fused.py)."""
        y = None
        # Not where a LoRA trains: its deltas go into row slices of the outputs in place
        # (one slice per adapter), and on views of one joint output each such add makes the
        # backward copy the whole joint gradient (autograd's CopySlices): 8 x 512 tokens on
        # the 8B took 413 ms a round against 384 ms with the modules' own GEMMs (2 rounds).
        if joint is not None and self.fused.gemm and (lora is None
                                                      or not torch.is_grad_enabled()):
            y, ys = joint(x)
        else:
            ys = [F.linear(x, m.weight, m.bias) for m in modules]
        if lora is None:
            return ys, y
        if self.fuse_lora and hasattr(lora, "apply_shared"):
            return lora.apply_shared(keys, x, ys), y
        return [lora.apply(key, x, y) for key, y in zip(keys, ys, strict=True)], y

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        if self.hybrid is not None:
            raise EngineInputError("model", "the padded sampler has no linear-attention state; "
                                   "Qwen3.5 samples through the running batch")
        if self.latent is not None:  # MLA's latent (mla.py)
            return self.latent.new_cache(batch, max_len)
        return KVCache(len(self.layers), batch, self.n_kv, max_len, self.head_dim,
                       self.dtype, self.device)


def _eos_ids(config, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids
