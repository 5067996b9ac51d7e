"""The padded sampler's key/value cache (model.py's `new_cache`, mla.py's latent one)."""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys and values for every layer: [layers, batch, kv_heads, max_len, dim].

    Eager use writes at `length` and returns the filled prefix. With `index` set (a device
    tensor holding the write position), writes go through `index_copy_` and the whole
    buffer is returned, so a decode step has fixed shapes and can be a CUDA graph; the
    attention mask then hides positions not yet written.
    """

    def __init__(self, n_layers, batch, n_kv, max_len, head_dim, dtype, device):
        shape = (n_layers, batch, n_kv, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # positions filled; the next eager forward writes from here
        self.index: torch.Tensor | None = None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.index is not None:
            self.k[layer].index_copy_(2, self.index, k)
            self.v[layer].index_copy_(2, self.index, v)
            return self.k[layer], self.v[layer]
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]
