"""Local mode: the engine in this process (the same engine the daemon's workers run).

A backend does what the model layer (model.py) asks, in token datums; the two backends,
this one and the daemon's (client.py), take the same calls and give the same numbers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

Row = dict[str, list]  # tokens, target_tokens, weights / logprobs / advantages (per token)
Output = dict[str, list[float]]  # per datum: logprobs, elementwise_loss


class LocalBackend:
    def __init__(self, model_dir: Path, output_dir: str | Path | None = None):
        import torch

        from twinkled.engine import Engine

        from .runtime import rank_and_world

        rank, world = rank_and_world()
        cuda = torch.cuda.is_available()
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu"
        group = None
        if world > 1:
            import torch.distributed as dist

            group = dist.group.WORLD
        self.engine = Engine(model_dir, dtype="bfloat16" if cuda else "float32", device=device,
                             dp_group=group)
        self.rank, self.world = rank, world
        # Never the working directory by default.
        self.output_dir = Path(output_dir or Path.home() / ".cache" / "twinkle" / "output")
        self.name: str | None = None
        self.model_dir = model_dir

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vision(self):
        """The model's image spec (images.Vision), None for a text model."""
        from .images import Vision

        return Vision.of(self.model_dir)

    def _prepared(self, images: list) -> list:
        from twinkled.protocol.images import patches

        return [patches(im, self.vision.spec) for im in images]

    def create(self, name: str, rank: int, alpha: float, targets: dict[str, bool],
               seed: int) -> None:
        from twinkled.protocol.types import LoraConfig

        self.engine.add_adapter(name, LoraConfig(rank=rank, alpha=alpha, seed=seed, **targets))
        self.name = name

    def forward_backward(self, rows: list[Row], loss_fn: str | Callable, config: dict,
                         forward_only: bool) -> tuple[list[Output], dict[str, float]]:
        from twinkled.protocol.types import Datum, ForwardBackwardRequest

        data = [Datum(r["tokens"], {k: v for k, v in r.items() if k not in ("tokens", "images")},
                      images=self._prepared(r.get("images", []))) for r in rows]
        req = ForwardBackwardRequest(self.name, data, loss_fn, config, forward_only)
        result = self.engine.forward_backward([req])[0]
        outputs = [{k: v.tolist() for k, v in o.items()} for o in result.outputs]
        return outputs, result.metrics

    def optim_step(self, params: dict) -> dict[str, float]:
        from twinkled.protocol.types import AdamParams

        result = self.engine.optim_step(self.name, AdamParams(**params))
        return {k: v for k, v in result.metrics.items() if isinstance(v, int | float)}

    def save(self, name: str, optimizer: bool) -> str:
        path = self.output_dir / name
        if self.rank == 0:  # every rank holds the same adapter
            self.engine.save(self.name, path, optimizer=optimizer)
        return str(path)

    def load(self, path: str, optimizer: bool) -> None:
        self.engine.load(self.name, path, optimizer=optimizer)

    def sample(self, prompts: list[list], params: dict, num_samples: int,
               use_adapter: bool = True) -> list[list[tuple[list[int], list[float], str]]]:
        """`prompts`: token ids, and ImageChunks where images go (images.py)."""
        from twinkled.protocol.types import SampleRequest, SamplingParams

        from .images import expand_prompt

        adapter = self.name if use_adapter else None
        seed = params.get("seed")
        reqs = []
        for i, p in enumerate(prompts):
            ids, images = expand_prompt(p, self.vision)
            reqs.append(SampleRequest(adapter, ids, SamplingParams(
                **{**params, "seed": None if seed is None else seed + i}), num_samples,
                images=tuple(self._prepared(images))))
        return [[(s.tokens, s.logprobs, s.stop_reason) for s in r.sequences]
                for r in self.engine.sample(reqs)]

    def sync_sampler(self) -> None:
        """Nothing to copy: the sampler reads the adapter the model trains, in place."""
