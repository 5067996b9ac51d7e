"""Remote mode: the same model API against a `twinkled` daemon.

The transport is the pinned `tinker` SDK (the daemon speaks its protocol; the SDK already
does futures, retries and protobuf). What the Tinker wire has no field for travels as
`user_metadata` keys prefixed `twinkle.` (the LoRA alpha), which the daemon reads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .local import Output, Row
from .runtime import runtime
from .tracking import DaemonMetrics

T = 600  # seconds to wait for one result


class TwinkleClient:
    """What `init_twinkle_client` returns: runs and checkpoints of this API key's tenant."""

    def __init__(self, base_url: str, api_key: str):
        import tinker

        self.base_url, self.api_key = base_url, api_key
        self.service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        self.rest = tinker.RestClient(base_url=base_url, api_key=api_key)

    def list_training_runs(self, limit: int = 100) -> list:
        return list(self.rest.list_training_runs(limit=limit).result(timeout=T).training_runs)

    def list_checkpoints(self, run_id: str) -> list[CheckpointInfo]:
        found = self.rest.list_checkpoints(run_id).result(timeout=T).checkpoints
        return [CheckpointInfo(c) for c in found]


class CheckpointInfo:
    """A listed checkpoint; `twinkle_path` (the seed scripts' name) is its tinker:// path."""

    def __init__(self, checkpoint: Any):
        self._c = checkpoint

    @property
    def twinkle_path(self) -> str:
        return self._c.tinker_path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)

    def __repr__(self) -> str:
        return f"CheckpointInfo({self._c.tinker_path!r})"


def init_twinkle_client(base_url: str, api_key: str) -> TwinkleClient:
    """Train on a daemon from here on: models created after this call are remote."""
    runtime.client = TwinkleClient(base_url, api_key)
    runtime.mode = "client"
    return runtime.client


def init_tinker_compat_client(base_url: str, api_key: str):
    """A plain `tinker.ServiceClient` for the daemon (the seed's Tinker-style scripts)."""
    import tinker

    return tinker.ServiceClient(base_url=base_url, api_key=api_key)


def served_name(model_id: str) -> str:
    """What the daemon calls its model: `ms://Org/Name` -> `Org/Name`; a path -> its name."""
    name = model_id.split("://", 1)[-1]
    return Path(name).name if Path(name).exists() else name


class RemoteBackend:
    def __init__(self, client: TwinkleClient, model_id: str):
        self.client = client
        self.base_model = served_name(model_id)
        self.model_dir = model_id if Path(model_id).is_dir() else None  # (images' spec)
        self.tc = None
        self.sampler = None
        self.name: str | None = None
        self.metadata: dict[str, str] = {}

    @property
    def tokenizer(self):
        return self.tc.get_tokenizer()

    @property
    def vision(self):
        """The model's image spec (images.Vision) where its files are here (model_id a
        local directory); else None: rows with images are refused."""
        from .images import Vision

        return Vision.of(self.model_dir)

    def _input(self, tokens: list[int], images: list):
        import tinker

        from .images import tinker_input

        if not images:
            return tinker.types.ModelInput.from_ints(tokens)
        return tinker_input(tokens, images, self.vision.pad)

    def daemon_metrics(self) -> DaemonMetrics:
        """report_to="twinkle": metrics to this model's run (the latest, after a load)."""
        return DaemonMetrics(self.client.base_url, self.client.api_key,
                             lambda: self.tc.model_id if self.tc is not None else None)

    def create(self, name: str, rank: int, alpha: float, targets: dict[str, bool],
               seed: int) -> None:
        # tinker 0.38 hands back a future of the client; using it as the client is deprecated
        # (a FutureWarning per call site), so wait for the client itself.
        self.metadata = {"twinkle.lora_alpha": str(alpha), "twinkle.adapter": name}
        self.tc = self.client.service.create_lora_training_client(
            base_model=self.base_model, rank=rank, seed=seed, **targets,
            user_metadata=self.metadata).result(timeout=T)
        self.name = name

    def forward_backward(self, rows: list[Row], loss_fn: str | Callable, config: dict,
                         forward_only: bool) -> tuple[list[Output], dict[str, float]]:
        import tinker

        if not isinstance(loss_fn, str):
            from twinkle_sdk.losses import BUILTIN_LOSSES

            raise ValueError("a Python loss function runs only in local mode; a daemon runs "
                             f"the built-in losses: {', '.join(BUILTIN_LOSSES)}")
        data = [tinker.types.Datum(
            model_input=self._input(r["tokens"], r.get("images", [])),
            loss_fn_inputs={k: v for k, v in r.items() if k not in ("tokens", "images")})
            for r in rows]
        call = self.tc.forward if forward_only else self.tc.forward_backward
        out = call(data, loss_fn, config or None).result(timeout=T)
        outputs = [{k: v.tolist() for k, v in o.items()} for o in out.loss_fn_outputs]
        return outputs, dict(out.metrics)

    def optim_step(self, params: dict) -> dict[str, float]:
        import tinker

        out = self.tc.optim_step(tinker.types.AdamParams(**params)).result(timeout=T)
        return dict(out.metrics or {})

    def save(self, name: str, optimizer: bool) -> str:
        if optimizer:
            return self.tc.save_state(name).result(timeout=T).path
        return self.tc.save_weights_for_sampler(name).result(timeout=T).path

    def load(self, path: str, optimizer: bool) -> None:
        """Continue from a checkpoint. TrainingClient.load_state* is deprecated in tinker 0.38
        (its replacement makes a new training client from the checkpoint), so this model
        trains a new run from here on, with the same adapter settings."""
        service = self.client.service
        create = (service.create_training_client_from_state_with_optimizer if optimizer
                  else service.create_training_client_from_state)
        self.tc = create(path, user_metadata=self.metadata or None).result(timeout=T)
        self.sampler = None

    def sync_sampler(self) -> None:
        """The trained weights to a sampler on the same daemon (no bytes leave it)."""
        self.sampler = self.tc.save_weights_and_get_sampling_client().result(timeout=T)

    def sample(self, prompts: list[list[int]], params: dict, num_samples: int,
               use_adapter: bool = True) -> list[list[tuple[list[int], list[float], str]]]:
        import tinker

        from .images import expand_prompt

        if not use_adapter:
            raise ValueError("sampling the base model remotely: use a tinker SamplingClient")
        if self.sampler is None:
            self.sync_sampler()
        seed = params.get("seed")
        futures = [self.sampler.sample(
            self._input(*expand_prompt(p, self.vision)), num_samples,
            tinker.types.SamplingParams(**{**params, "seed": None if seed is None else seed + i}))
            for i, p in enumerate(prompts)]
        return [[(list(s.tokens), list(s.logprobs or []), s.stop_reason)
                 for s in f.result(timeout=T).sequences] for f in futures]
