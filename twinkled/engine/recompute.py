"""When a training pass recomputes its activations (checkpointing per decoder layer).

"off": never; "on": always; "auto" (the default): when the estimate of what the
micro-batch keeps for its backward (sizing.py) does not fit in the device memory free
now, so a model that fits only without its activations (Qwen3-14B on one 80 GB card)
trains at the cost of a second forward, and one that fits pays nothing. A CPU never
recomputes unless asked ("on").
"""

from __future__ import annotations

import torch

from twinkled.protocol.sizing import activation_bytes
from twinkled.protocol.types import EngineInputError

MODES = ("auto", "on", "off")
# The share of free memory a micro-batch's activations may take: allocator fragmentation
# and the estimate's error take the rest.
USABLE = 0.85


class Recompute:
    def __init__(self, sizes: dict, dtype: torch.dtype, device: torch.device, tp: int = 1,
                 group=None):
        self.sizes = sizes  # the model's config.json
        self.dtype_bytes = torch.empty((), dtype=dtype).element_size()
        self.device = device
        self.tp = tp
        # A tensor-parallel group must agree: a rank recomputing alone would run its
        # layers' collectives again in the backward, where the others do not.
        self.group = group
        self.mode = "auto"
        self.used = 0  # passes that recomputed (reported in the step metrics' stead: tests)

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise EngineInputError("activation_checkpointing",
                                   f"must be one of {MODES}, got {mode!r}")
        self.mode = mode

    def wanted(self, tokens: int) -> bool:
        if self.mode == "auto":
            on = self.device.type == "cuda" and self.need(tokens) > USABLE * self.free()
            if self.group is not None and self.device.type == "cuda":
                flag = torch.tensor(float(on), device=self.device)
                torch.distributed.all_reduce(flag, torch.distributed.ReduceOp.MAX,
                                             group=self.group)
                on = bool(flag.item())
        else:
            on = self.mode == "on"
        self.used += on
        return on

    def need(self, tokens: int) -> int:
        """Bytes a pass of `tokens` keeps for its backward without recomputing (every
        logit counted: a full-parameter run's whole-logits head too, and erring towards
        recomputing costs a forward, not an out-of-memory step)."""
        return activation_bytes(self.sizes, self.dtype_bytes, tokens, self.tp,
                                chunked_head=False)

    def free(self) -> int:
        """Device memory free now, counting what torch's allocator holds but does not use."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
