"""The model the seed scripts train: `TransformersModel` (in this process) and
`MultiLoraTransformersModel` (on a daemon), one API, one set of numbers.

Everything a training loop sees is decided here, once, for both backends:
- a batch of encoded rows becomes token datums; cross-entropy weights are 1 / (loss tokens
  in the batch x gradient_accumulation_steps), so the engine's summed loss is the batch's
  mean token loss and accumulated micro-batches average;
- `step()` applies AdamW only every `gradient_accumulation_steps` calls, with the learning
  rate of the scheduler (torch's and transformers' schedulers, run on a stand-in optimizer);
- metrics: mean token loss since the last `calculate_metric`, learning rate, grad norm;
  logged to TensorBoard / W&B when the user asks (`set_logger`, tracking.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .losses import BUILTIN_LOSSES
from .runtime import rank_and_world, runtime
from .schedules import make_schedule
from .tracking import MetricsLogger

_TARGETS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
            "mlp": ("gate_proj", "up_proj", "down_proj"), "unembed": ("lm_head",)}


def lora_targets(target_modules: Any) -> dict[str, bool]:
    """peft's target_modules ('all-linear', names) -> the engine's train_attn/mlp/unembed."""
    if target_modules in (None, "all-linear", "all_linear"):
        return {"train_attn": True, "train_mlp": True, "train_unembed": False}
    names = {target_modules} if isinstance(target_modules, str) else set(target_modules)
    names = {n.rsplit(".", 1)[-1] for n in names}
    known = {n for group in _TARGETS.values() for n in group}
    if names - known:
        raise ValueError(f"cannot adapt {sorted(names - known)}; adaptable modules: "
                         f"{sorted(known)} or 'all-linear'")
    return {f"train_{g}": bool(names & set(mods)) for g, mods in _TARGETS.items()}


class TwinkleModel:
    """One LoRA adapter on a base model, trained with a visible loop."""

    def __init__(self, backend):
        self.backend = backend
        self.adapter: str | None = None
        self.accum = 1
        self.loss_fn: str | Callable = "cross_entropy"
        self.loss_config: dict[str, float] = {}
        self.optim = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                      "weight_decay": 0.0}
        self.schedule = None
        self.clip: float = 0.0
        self.micro = 0  # micro-batches since the last optimizer step
        self.steps = 0
        self.stepped = False  # the last step() call applied the optimizer
        self.template = None
        self._train = _Mean()
        self._eval = _Mean()
        self._last: dict[str, float] = {}
        self.logger: MetricsLogger | None = None  # off unless asked for

    # -- configuration ------------------------------------------------------------------

    def add_adapter_to_model(self, name: str, config: Any = None,
                             gradient_accumulation_steps: int = 1) -> None:
        """`config`: a peft LoraConfig (r, lora_alpha, target_modules) or a dict of those.
        `r=0`: a full-parameter run (every weight trains; through a daemon it holds a lane
        of its own: docs/reference.md, "Full-parameter runs")."""
        get = (config.get if isinstance(config, dict) else
               (lambda k, d=None: getattr(config, k, d)))
        r = get("r", 8)
        rank = 8 if r is None else int(r)
        alpha = float(get("lora_alpha", rank) or rank or 32)  # (rank 0 has no alpha)
        self.backend.create(name, rank, alpha, lora_targets(get("target_modules", None)),
                            runtime.seed)
        self.adapter, self.accum = name, max(1, int(gradient_accumulation_steps))

    def set_template(self, name: str = "Template", **kwargs) -> None:
        from .template import get_template

        kwargs.setdefault("model_id", str(getattr(self.backend, "model_dir", "")) or None)
        self.template = get_template(name, **kwargs)

    def set_processor(self, processor: Any = "InputProcessor", **kwargs) -> None:
        """Accepted for the seed scripts: rows are padded and batched by the engine itself."""

    def set_loss(self, loss: str | Callable, **config: float) -> None:
        if callable(loss):
            self.loss_fn, self.loss_config = loss, {}
            return
        if loss not in BUILTIN_LOSSES:
            raise ValueError(f"unknown loss {loss!r}; built-in losses: "
                             f"{', '.join(BUILTIN_LOSSES)}, or a Python callable (local mode)")
        self.loss_fn = BUILTIN_LOSSES[loss]
        if "epsilon" in config:  # GRPO's clip range around a ratio of 1
            eps = config.pop("epsilon")
            high = config.pop("epsilon_high", None) or eps
            config.update(clip_low_threshold=1 - eps, clip_high_threshold=1 + high)
        self.loss_config = {k: float(v) for k, v in config.items()}

    def set_optimizer(self, optimizer_cls: str = "AdamW", lr: float = 1e-4,
                      weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                      eps: float = 1e-8, **_ignored) -> None:
        if optimizer_cls not in ("AdamW", "Adam"):
            raise ValueError(f"optimizer {optimizer_cls!r} is not supported; use AdamW")
        self.optim = {"learning_rate": float(lr), "beta1": betas[0], "beta2": betas[1],
                      "eps": float(eps), "weight_decay": float(weight_decay)}

    def set_lr_scheduler(self, scheduler_cls: str, **kwargs) -> None:
        self.schedule = make_schedule(scheduler_cls, self.optim["learning_rate"], **kwargs)

    def get_train_configs(self) -> dict[str, Any]:
        return {"adapter": self.adapter, "gradient_accumulation_steps": self.accum,
                "loss": self.loss_fn if isinstance(self.loss_fn, str) else "custom",
                "loss_config": self.loss_config, "optimizer": {"AdamW": self.optim},
                "lr_scheduler": self.schedule.name if self.schedule else None,
                "backend": type(self.backend).__name__}

    # -- the loop -----------------------------------------------------------------------

    def forward_backward(self, inputs: list[dict], old_logps: list[list[float]] | None = None,
                         advantages: list[float] | None = None, **_ignored) -> dict[str, float]:
        """Gradients of the loss over `inputs` (encoded rows) accumulate until `step`.

        For RL losses, `old_logps` holds each row's sampler logprobs of its completion tokens
        and `advantages` one number per row."""
        return self._run(inputs, old_logps, advantages, forward_only=False)

    def forward_only(self, inputs: list[dict], **kwargs) -> dict[str, float]:
        return self._run(inputs, kwargs.get("old_logps"), kwargs.get("advantages"),
                         forward_only=True)

    def calculate_loss(self) -> float:
        """The mean token loss of the last forward (e.g. an eval batch)."""
        return self._last.get("loss", math.nan)

    def clip_grad_norm(self, max_grad_norm: float = 1.0) -> None:
        self.clip = float(max_grad_norm)

    def step(self) -> None:
        """AdamW on the accumulated gradients, every `gradient_accumulation_steps` calls."""
        self.micro += 1
        self.stepped = self.micro >= self.accum
        if not self.stepped:
            return
        self.micro = 0
        lr = self.schedule.lr if self.schedule else self.optim["learning_rate"]
        metrics = self.backend.optim_step({**self.optim, "learning_rate": lr,
                                           "grad_clip_norm": self.clip})
        self.steps += 1
        self._train.add("lr", lr)
        if "grad_norm:mean" in metrics:
            self._train.add("grad_norm", metrics["grad_norm:mean"])

    def zero_grad(self) -> None:
        """The optimizer step clears the gradients it used; nothing else holds any."""

    def lr_step(self) -> None:
        if self.stepped and self.schedule is not None:
            self.schedule.step()

    def clip_grad_and_step(self, max_grad_norm: float = 1.0) -> None:
        self.clip_grad_norm(max_grad_norm)
        self.step()
        self.zero_grad()
        self.lr_step()

    def calculate_metric(self, is_training: bool = True) -> dict[str, float]:
        """Means since the last call (training or eval), then start again."""
        acc = self._train if is_training else self._eval
        out = acc.means()
        if self.logger is not None and out:
            self.logger.log(out, self.steps, "train/" if is_training else "eval/")
        if is_training:
            out["steps"] = self.steps
        acc.reset()
        return out

    def set_logger(self, logger: MetricsLogger | None) -> None:
        """Where `calculate_metric`'s means go from now on (None: nowhere)."""
        self.logger = logger

    # -- checkpoints --------------------------------------------------------------------

    def save(self, name: str, save_optimizer: bool = True) -> str:
        """A checkpoint; returns its path (a directory locally, tinker:// on a daemon)."""
        return self.backend.save(name, save_optimizer)

    def load(self, path: str, load_optimizer: bool = False) -> None:
        self.backend.load(path, load_optimizer)

    # -- internals ----------------------------------------------------------------------

    def _run(self, inputs, old_logps, advantages, forward_only: bool) -> dict[str, float]:
        from .batch import rows_to_datums

        rows, masks = rows_to_datums(inputs, self.backend.vision)
        count = _global_sum(sum(sum(m) for m in masks))
        rl = self.loss_fn != "cross_entropy" and isinstance(self.loss_fn, str)
        if rl:
            if old_logps is None or advantages is None:
                raise ValueError(f"loss {self.loss_fn!r} needs old_logps and advantages")
            _add_rl_inputs(rows, masks, old_logps, advantages, _global_sum(len(rows)))
        elif isinstance(self.loss_fn, str):
            scale = 1.0 / max(1.0, count) / self.accum
            for r, m in zip(rows, masks, strict=True):
                r["weights"] = [scale * x for x in m]
        outputs, metrics = self.backend.forward_backward(rows, self.loss_fn, self.loss_config,
                                                         forward_only)
        nll = -sum(lp for o, m in zip(outputs, masks, strict=True)
                   for lp, x in zip(o["logprobs"], m, strict=True) if x)
        loss = _global_sum(nll) / max(1.0, count)
        self._last = {"loss": loss}
        acc = self._eval if forward_only else self._train
        acc.add("loss", loss)
        if rl:
            acc.add("rl_loss", _global_sum(metrics.get("loss:sum", 0.0)))
        return {"loss": loss, "tokens": count}


def _add_rl_inputs(rows, masks, old_logps, advantages, n_rows: float) -> None:
    """Per-token sampler logprobs and advantages on the completion tokens. Advantages are
    scaled by 1 / (completion tokens x rows): a sequence-mean, then batch-mean, GRPO loss."""
    if len(old_logps) != len(rows) or len(advantages) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(old_logps)} old_logps and "
                         f"{len(advantages)} advantages")
    for i, (r, m, lps, adv) in enumerate(zip(rows, masks, old_logps, advantages, strict=True)):
        n = sum(m)
        if len(lps) != n:
            raise ValueError(f"row {i}: {n} completion tokens but {len(lps)} old_logps")
        it = iter(lps)
        r["logprobs"] = [next(it) if x else 0.0 for x in m]
        scaled = float(adv) / max(1, n) / n_rows
        r["advantages"] = [scaled if x else 0.0 for x in m]


def _global_sum(x: float) -> float:
    """Summed over data-parallel ranks (local mode under torchrun), else `x`."""
    _, world = rank_and_world()
    if world == 1:
        return float(x)
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


class _Mean:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.counts[key] = self.counts.get(key, 0) + 1

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}


def _with_logger(model: TwinkleModel, report_to: str | list[str] | None,
                 logging_dir: str) -> TwinkleModel:
    """`report_to` ("tensorboard", "wandb", "jsonl", "twinkle" or a list), as transformers'
    Trainer takes it: a MetricsLogger writing under `logging_dir` (or to the daemon)."""
    if report_to and report_to != "none":
        daemon = getattr(model.backend, "daemon_metrics", None)
        model.set_logger(MetricsLogger(report_to, logging_dir,
                                       daemon=daemon() if daemon is not None else None))
    return model


def TransformersModel(model_id: str, output_dir: str | None = None,  # noqa: N802
                      report_to: str | list[str] | None = None, logging_dir: str = "runs",
                      **_ignored) -> TwinkleModel:
    """The model in this process (local mode); `model_id` is a path or hf:// / ms:// id."""
    from .hub import resolve_model_dir
    from .local import LocalBackend

    model = TwinkleModel(LocalBackend(resolve_model_dir(model_id), output_dir))
    return _with_logger(model, report_to, logging_dir)


def MultiLoraTransformersModel(model_id: str, report_to: str | list[str] | None = None,  # noqa: N802
                               logging_dir: str = "runs", **_ignored) -> TwinkleModel:
    """The model on the daemon given to `init_twinkle_client` (it shares the base model
    with other tenants' adapters)."""
    from .client import RemoteBackend

    if runtime.client is None:
        raise RuntimeError("call init_twinkle_client(base_url, api_key) first")
    model = TwinkleModel(RemoteBackend(runtime.client, model_id))
    return _with_logger(model, report_to, logging_dir)
