"""Tensor parallelism for Gated DeltaNet layers (Qwen3.5, Qwen3-Next: qwen35.py), by heads.

Linear attention's heads are independent, like attention's: rank r of `size` keeps key
heads r * nk / size .. (r + 1) * nk / size and the value heads that read them (nv / nk per
key head, consecutive), and everything that is per head follows them:
- in_proj_qkv's rows come in three blocks (every q head, every k head, every v head), so a
  rank's rows are a slice of each block: an index, not a slice (`rows`). The conv's
  channels are the same q|k|v layout (Qwen3-Next's too: it regroups before the conv), so
  they take the same index;
- in_proj_z / in_proj_b / in_proj_a and Qwen3-Next's fused in_proj_qkvz / in_proj_ba are
  laid out head by head (z, b, a by value head; Qwen3-Next's by key-head group): a
  rank's rows are one even slice (tp.py's column-parallel rule);
- A_log and dt_bias are per value head; the gated norm's weight is per head width, whole;
- out_proj is row-parallel (its input is the value heads), as o_proj.
After the split each module's head counts and widths (`localize`) are the rank's, so the
layer's code (qwen35.py), the sampler's recurrent states (recurrent.py) and fla's
kernels all see a model with fewer heads.
"""

from __future__ import annotations

import torch

# Column-parallel by an even slice of the output rows (tp.py's ShardPlan.slices).
EVEN = ("in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba")
PER_V_HEAD = ("A_log", "dt_bias")


class LinearAttnSplit:
    """Which rows of a Gated DeltaNet layer's tensors each rank of a group holds."""

    def __init__(self, config, size: int):
        self.size = size
        self.nk, self.nv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        self.dk, self.dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)

    def rows(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s rows of in_proj_qkv (and channels of the conv): its q heads, its
        k heads and its v heads out of the three blocks."""
        kd, k_per, v_per = self.nk * self.dk, self.nk // self.size, self.nv // self.size
        q = torch.arange(rank * k_per * self.dk, (rank + 1) * k_per * self.dk)
        v = torch.arange(rank * v_per * self.dv, (rank + 1) * v_per * self.dv)
        return torch.cat([q, kd + q, 2 * kd + v])

    def v_heads(self, rank: int) -> slice:
        per = self.nv // self.size
        return slice(rank * per, (rank + 1) * per)

    def localize(self, module) -> None:
        """Set a split module's head counts and widths to this rank's (its tensors are
        already sliced): what its own attributes say is what the layer then runs."""
        module.num_k_heads = self.nk // self.size
        module.num_v_heads = self.nv // self.size
        module.key_dim = module.num_k_heads * self.dk
        module.value_dim = module.num_v_heads * self.dv
        module.conv_dim = 2 * module.key_dim + module.value_dim
