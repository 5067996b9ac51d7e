"""Tensor parallelism: a base model split over the ranks of a tensor-parallel group.

Megatron's layout. In every decoder layer q/k/v and gate/up are column-parallel (each rank
holds a slice of the output features: whole attention heads, a slice of the MLP) and
o_proj/down_proj are row-parallel (the matching slice of the input features); the
residual stream and norms are replicated. Multi-head latent attention (DeepSeek-V3, mla.py)
splits the same way by heads: q_b_proj (or q_proj) and kv_b_proj column-parallel, o_proj
row-parallel; its down-projections to the latents and their norms are whole on every
rank, and the sampler's latent cache is the same on every rank; Gated DeltaNet
(tp_linear.py) splits by its heads too. The embedding and lm_head are split over the
vocabulary when the group divides it (Qwen's 151,936 and Llama-3's 128,256 rows do, for
2, 4 and 8 ranks; otherwise both stay whole): a rank looks up the ids in its rows and the
group sums, and lm_head is column-parallel, so a rank holds only its share of the logits
(a 4k-token step of a 152k vocabulary is 2.5 GB of them in fp32). The training logprobs
come from those shares with three all-reduces of one number per token (`target_logprobs`);
sampling gathers the whole logits of the few positions it reads. Per layer that is one
collective forward (megatron's `reduce_from_tensor_model_parallel_region` after o_proj
and after down_proj) and one backward (`copy_to_tensor_model_parallel_region` in front of
q/k/v and gate/up, whose backward sums the input gradient). KV heads fewer than the
group are replicated: rank r holds kv head r * n_kv // tp, the one its query heads use.

LoRA follows the split: a column-parallel module's A is replicated and its B split like
the base rows; a row-parallel module's A is split like the base columns and its B
replicated. The delta rides inside the same collectives (for a row-parallel module,
sum_r (x_r A_r^T) B^T = (x A^T) B^T, so it is added before the reduce). The adapters'
gradients go straight into bank buffers outside autograd (lora.py), so the parts every
rank computes only a share of, A of a column-parallel module and B of a row-parallel one,
are summed over the group before the optimizer step (`reduce_grads`); AdamW is
elementwise, so each rank then steps its own slice.

Checkpoints never depend on the split: saving gathers every tensor whole (`gather_views`),
loading slices (`ShardPlan.local_lora`). The base weights are read slice by slice from the
safetensors files (`tp_load.py`), never whole.

megatron-core is imported only here, and only when tp > 1. With megatron-core 0.16.1 on a
CPU, `parallel_state.initialize_model_parallel` builds its groups with the default
(gloo) backend and the copy/reduce mappings work over gloo; the gather mapping allocates
on CUDA, so the vocabulary's shares are joined with plain collectives here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinkled.protocol.sizing import split_problem
from twinkled.protocol.types import EngineInputError

from .losses import logprob_grad
from .moe_peft import is_expert
from .tp_linear import EVEN, LinearAttnSplit

# MLA (mla.py): q_b_proj and kv_b_proj give whole heads, as q_proj does; Gated DeltaNet
# (tp_linear.py): its input projections give whole heads, out_proj reads them.
COLUMN = ("q_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj", "in_proj_qkv", *EVEN)
KV = ("k_proj", "v_proj")
ROW = ("o_proj", "down_proj", "out_proj")
# MLA's down-projections to the latents: whole on every rank (the latent is small and
# every head reads it), but inside the split region, so each rank's gradient is only its
# heads' share of the whole: both A's and B's are summed over the group.
SHARED_IN_SPLIT = ("q_a_proj", "kv_a_proj_with_mqa")


class NoSplit:
    """One rank holds the whole model: the mappings are the identity."""

    size = 1
    group = None

    @staticmethod
    def enter(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def leave(y: torch.Tensor) -> torch.Tensor:
        return y


class TensorParallel:
    """This process's place in megatron's parallel state: its tensor-parallel group of
    `size` consecutive ranks, and the data-parallel group across the replicas.

    torch.distributed must be initialised (the worker does, NCCL or gloo)."""

    def __init__(self, size: int):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import mappings

        world = dist.get_world_size()
        if size < 1 or world % size:
            raise EngineInputError("tp", f"tensor-parallel size {size} does not divide the "
                                   f"{world} ranks of the worker group")
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=size)
        self.size = size
        self.rank = ps.get_tensor_model_parallel_rank()
        self.group = ps.get_tensor_model_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group() if self.dp_size > 1 else None
        self._mappings = mappings

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """In front of column-parallel modules: forward identity, backward sums the input
        gradient over the group."""
        return self._mappings.copy_to_tensor_model_parallel_region(x, group=self.group)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """After a row-parallel module: sums the partial outputs over the group."""
        return self._mappings.reduce_from_tensor_model_parallel_region(y, group=self.group)

    def broadcast_seed(self) -> int:
        """A seed that every rank of the group shares: unseeded sampling must draw the same
        tokens on every rank, or their decode loops (and collectives) would part ways."""
        seed = torch.randint(0, 2**62, (1,), dtype=torch.long)
        if dist.get_backend(self.group) == "nccl":
            seed = seed.cuda()
        dist.broadcast(seed, dist.get_global_rank(self.group, 0), group=self.group)
        return int(seed.item())


class ShardPlan:
    """Which slice of each module, of the base weights and of a LoRA, this rank holds."""

    def __init__(self, config, tp: TensorParallel):
        self.tp = tp
        self.size, self.rank = tp.size, tp.rank
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.intermediate = config.intermediate_size
        problem = split_problem(config.to_dict(), self.size)
        if problem is not None:
            raise EngineInputError("tp", problem)
        if self.n_kv >= self.size:
            per = self.n_kv // self.size
            self.kv_heads = range(self.rank * per, (self.rank + 1) * per)
        else:  # replicated: the one kv head this rank's query heads read
            head = self.rank * self.n_kv // self.size
            self.kv_heads = range(head, head + 1)
        self.local_heads = self.n_heads // self.size
        self.local_kv = len(self.kv_heads)
        # Gated DeltaNet layers (Qwen3.5): their heads' rows (tp_linear.py); None: none.
        self.linear = (LinearAttnSplit(config, self.size) if "linear_attention" in (
            getattr(config, "layer_types", None) or ()) else None)
        self.vocab = config.vocab_size
        self.vocab_split = self.vocab % self.size == 0
        self.vocab_rows = self._even(self.vocab) if self.vocab_split else slice(0, self.vocab)
        # Every adaptable module's whole (in, out): set by the model once it has them.
        self.full_shapes: dict[str, tuple[int, int]] = {}

    def head_slice(self) -> slice:
        """The query heads this rank holds (whole heads: q_proj's rows come in blocks of
        them)."""
        return self._even(self.n_heads)

    def _even(self, n: int) -> slice:
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def _column(self, name: str) -> bool:
        """A module whose output features are split (lm_head: over the vocabulary)."""
        return name in COLUMN or (name == "lm_head" and self.vocab_split)

    def slices(self, key: str, shape: tuple[int, int]
               ) -> tuple[slice | torch.Tensor | None, slice | None]:
        """(rows of the weight [out, in] this rank holds, its columns); None = all; the
        rows of Gated DeltaNet's in_proj_qkv are an index (tp_linear.py). An MoE expert
        pair is whole: its experts, not its rows, are split (moe.py)."""
        if is_expert(key):
            return None, None
        name = key.rsplit(".", 1)[-1]
        if name == "in_proj_qkv":
            return self.linear.rows(self.rank), None
        fin, fout = shape
        if self._column(name):
            return self._even(fout), None
        if name in KV:
            d = self.head_dim
            return slice(self.kv_heads.start * d, self.kv_heads.stop * d), None
        if name in ROW:
            return None, self._even(fin)
        return None, None

    def holders(self, key: str) -> int:
        """How many ranks of the group hold the same rows of `key` (1: split)."""
        if is_expert(key):
            return self.size  # the banks keep every expert on every rank
        name = key.rsplit(".", 1)[-1]
        if name in KV:
            return max(1, self.size // self.n_kv)
        return 1 if self._column(name) or name in ROW else self.size

    def local_shape(self, key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if is_expert(key):
            return shape  # (in, out, experts): every expert, whole
        rows, cols = self.slices(key, shape)
        fin, fout = shape
        return (fin if cols is None else cols.stop - cols.start,
                fout if rows is None else rows.stop - rows.start if isinstance(rows, slice)
                else len(rows))

    def local_lora(self, key: str, part: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole LoRA tensor: A [r, in] or B [out, r] of `key`."""
        rows, cols = self.slices(key, self.full_shapes[key])
        if part == "A":
            return t if cols is None else t[:, cols]
        return t if rows is None else t[rows]

    # -- gradients --------------------------------------------------------------------

    def reduce_grads(self, adapters: list) -> None:
        """Sum, over the group, the gradient parts each rank computed only a share of:
        A of split-output modules (and kv modules), B of split-input ones, both of MLA's
        latent projections. One all-reduce
        for all of them; a replicated kv head's B is summed over the ranks that hold it."""
        summed, kv_b = [], []
        for a in adapters:
            bank = a.bank
            for key in bank.shapes:
                name = key.rsplit(".", 1)[-1]
                if is_expert(key):  # only the ranks owning an expert have its gradients
                    summed += [bank.gA[key][a.slot], bank.gB[key][a.slot]]
                elif self._column(name) or name in KV:
                    summed.append(bank.gA[key][a.slot])
                elif name in ROW:
                    summed.append(bank.gB[key][a.slot])
                elif name in SHARED_IN_SPLIT:
                    summed += [bank.gA[key][a.slot], bank.gB[key][a.slot]]
                if name in KV and self.holders(key) > 1:
                    kv_b.append(bank.gB[key][a.slot])
        if summed:
            flat = torch.cat([g.reshape(-1) for g in summed])
            dist.all_reduce(flat, group=self.tp.group)
            torch._foreach_copy_(summed, [p.view_as(g) for p, g in
                                          zip(flat.split([g.numel() for g in summed]), summed,
                                              strict=True)])
        if kv_b:
            flat = torch.cat([g.reshape(-1) for g in kv_b])
            parts = [torch.empty_like(flat) for _ in range(self.size)]
            dist.all_gather(parts, flat, group=self.tp.group)
            mine = self.kv_heads.start
            same = [r for r in range(self.size) if r * self.n_kv // self.size == mine]
            total = torch.stack([parts[r] for r in same]).sum(0)
            torch._foreach_copy_(kv_b, [p.view_as(g) for p, g in
                                        zip(total.split([g.numel() for g in kv_b]), kv_b,
                                            strict=True)])

    def grad_norms(self, grads: list[list[torch.Tensor]], keys: list[list[str]]) -> list[float]:
        """Each adapter's gradient norm over the whole (unsplit) adapter: squares of split
        parts summed over the group, a replicated part counted once."""
        flat = [g for gs in grads for g in gs]
        sq = torch.stack(torch._foreach_norm(flat)).float() ** 2
        weight = torch.tensor([1.0 / self._holders_of(k) for ks in keys for k in ks],
                              device=sq.device)
        per = torch.stack([x.sum() for x in (sq * weight).split([len(g) for g in grads])])
        dist.all_reduce(per, group=self.tp.group)
        return per.sqrt().tolist()

    def _holders_of(self, part_key: str) -> int:
        """`part_key` is "A:<module>" or "B:<module>"."""
        part, key = part_key.split(":", 1)
        if is_expert(key):
            return self.size
        name = key.rsplit(".", 1)[-1]
        split = (part == "B" and (self._column(name) or name in KV)) or (part == "A" and name in ROW)
        if not split:
            return self.size
        return self.holders(key) if name in KV else 1

    # -- the vocabulary -----------------------------------------------------------------

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The split embedding: each rank looks the ids up in its rows (zeros for the
        others' ids) and the group sums (megatron's reduce mapping)."""
        local = ids - self.vocab_rows.start
        outside = (local < 0) | (local >= weight.shape[0])
        h = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
        return self.tp.leave(h.masked_fill(outside[..., None], 0))

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary logits from each rank's share (sampling: no gradient)."""
        if torch.is_grad_enabled() and local.requires_grad:
            raise RuntimeError("whole logits under a vocabulary split carry no gradient: "
                               "train through target_logprobs")
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp.group)
        return torch.cat(parts, -1)

    def target_logprobs(self, local: torch.Tensor, targets: torch.Tensor,
                        chunk_bytes: int = 256 * 2**20) -> torch.Tensor:
        """Per-token logprob of `targets` [B, S] (or [B, S, K]) from this rank's share of
        the logits [B, S, V / tp], as fp32 of the targets' shape (losses.target_logprobs
        over the whole vocabulary)."""
        chunk = max(1, chunk_bytes // (4 * local.shape[-1]))
        return _SplitTargetLogprobs.apply(local, targets, self.vocab_rows.start,
                                          self.tp.group, chunk)

    # -- whole tensors for checkpoints --------------------------------------------------

    def gather_views(self, keys: list[str], views: list[torch.Tensor]) -> list[torch.Tensor]:
        """Whole tensors from this rank's slices. `views` repeats [A of every key, B of
        every key] (weights, then each moment), as `Bank.tensors` orders a slot."""
        n = len(keys)
        out = []
        for i, v in enumerate(views):
            key = keys[i % n]
            part = "A" if (i // n) % 2 == 0 else "B"
            rows, cols = self.slices(key, self.full_shapes[key])
            dim = 1 if part == "A" and cols is not None else 0 if part == "B" and rows is not None else None
            if dim is None:
                out.append(v)
                continue
            parts = [torch.empty_like(v) for _ in range(self.size)]
            dist.all_gather(parts, v.contiguous(), group=self.tp.group)
            if key.rsplit(".", 1)[-1] in KV and self.holders(key) > 1:
                parts = [parts[r] for r in range(0, self.size, self.holders(key))]
            whole = torch.cat(parts, dim)
            if isinstance(rows, torch.Tensor) and dim == 0:  # each rank's rows, in place
                order = torch.cat([self.linear.rows(r) for r in range(self.size)]
                                  ).to(whole.device)
                whole = torch.empty_like(whole).index_copy_(0, order, whole)
            out.append(whole)
        return out


class _SplitTargetLogprobs(torch.autograd.Function):
    """log_softmax(logits)[target] when each rank holds a slice of the vocabulary: the
    group's max and sum of exponentials per token, and each target's logit from the rank
    that holds it, are three all-reduces of a number a token. The backward needs none:
    d lp / d logits = onehot(target) - softmax, and each rank has its softmax's share."""

    @staticmethod
    def forward(ctx, logits, targets, start, group, chunk):
        flat = logits.reshape(-1, logits.shape[-1])
        n, width = flat.shape
        local = targets.reshape(n, -1) - start  # [tokens, K]
        mine = (local >= 0) & (local < width)
        local = local.clamp(0, width - 1)
        top = torch.empty(n, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk):
            top[s:s + chunk] = flat[s:s + chunk].amax(-1).float()
        dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
        total = torch.empty_like(top)
        for s in range(0, n, chunk):
            total[s:s + chunk] = (flat[s:s + chunk].float() - top[s:s + chunk, None]).exp_().sum(-1)
        dist.all_reduce(total, group=group)
        lse = top + total.log()
        picked = flat.gather(1, local).float() * mine
        dist.all_reduce(picked, group=group)
        ctx.save_for_backward(logits, local, mine, lse)
        ctx.chunk = chunk
        return (picked - lse[:, None]).view(targets.shape)

    @staticmethod
    def backward(ctx, grad_lp):
        logits, local, mine, lse = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        g = grad_lp.reshape(flat.shape[0], -1).float()
        # A target outside this rank's slice has no logit here; the softmax part still does.
        grad = logprob_grad(flat, lse, local, g * mine, g.sum(1, keepdim=True), ctx.chunk)
        return grad.view(logits.shape), None, None, None, None
