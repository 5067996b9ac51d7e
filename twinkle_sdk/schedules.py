"""Learning-rate schedules by the seed scripts' names, computed by torch's and transformers'
own schedulers on a stand-in optimizer (the real optimizer lives in the engine)."""

from __future__ import annotations

SCHEDULES = ("CosineWarmupScheduler", "LinearLR", "CosineAnnealingLR", "ConstantLR")


class Schedule:
    def __init__(self, name: str, scheduler, optimizer):
        self.name = name
        self._scheduler, self._optimizer = scheduler, optimizer

    @property
    def lr(self) -> float:
        return float(self._optimizer.param_groups[0]["lr"])

    def step(self) -> None:
        self._optimizer.step()  # a no-op (no gradients); torch warns if it never runs
        self._scheduler.step()


def make_schedule(name: str, base_lr: float, **kwargs) -> Schedule:
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    if name == "CosineWarmupScheduler":
        from transformers import get_cosine_schedule_with_warmup

        sched = get_cosine_schedule_with_warmup(
            opt, kwargs.get("num_warmup_steps", 0), kwargs["num_training_steps"])
    elif name in ("LinearLR", "CosineAnnealingLR", "ConstantLR"):
        if name == "CosineAnnealingLR":
            kwargs.setdefault("T_max", kwargs.pop("num_training_steps", 100))
        sched = getattr(torch.optim.lr_scheduler, name)(opt, **kwargs)
    else:
        raise ValueError(f"unknown lr scheduler {name!r}; known: {', '.join(SCHEDULES)}")
    return Schedule(name, sched, opt)
