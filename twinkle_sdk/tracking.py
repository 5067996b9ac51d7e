"""Training curves where people look: TensorBoard, Weights & Biases, or a JSON-lines file,
when the user asks for them (nothing is logged by default).

    model.set_logger(MetricsLogger(report_to=["tensorboard", "wandb"], log_dir="runs/sft"))

or `TransformersModel(..., report_to="tensorboard", logging_dir="runs/sft")`, as
transformers' TrainingArguments spell it. Each `calculate_metric` call then logs its
means (loss, lr, grad_norm, ...) under `train/` or `eval/` at the optimizer step count.

The writers are optional dependencies, imported only when asked for: TensorBoard through
`torch.utils.tensorboard` where the `tensorboard` package is installed, else `tensorboardX`
(no torch: what a client of a daemon wants); W&B through `wandb`, offline unless asked
(`wandb_mode="online"` or WANDB_MODE), so a run on a box without network still logs and
`wandb sync` uploads it later.

"twinkle" posts them to the daemon the model trains on (a model made after
`init_twinkle_client`), where the web console draws them on the run's page
(`POST /twinkle/v1/runs/{run_id}/metrics`): what the daemon cannot see itself, such as
an RL loop's reward mean, beside the losses it records. `DaemonMetrics` is that sink on
its own (any script: `DaemonMetrics(base_url, api_key, run_id).log({...}, step)`), and
`twinkle_sdk.cookbook_log.TwinkleMetricsLogger` the same for tinker-cookbook's loggers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SINKS = ("tensorboard", "wandb", "jsonl", "twinkle")
POST_T = 30  # seconds one report to the daemon may take


class MetricsLogger:
    """Records of (step, metrics) sent to each writer asked for; the records stay in
    `records` too (a notebook can plot them without any writer)."""

    def __init__(self, report_to: str | Sequence[str] = "tensorboard",
                 log_dir: str | Path = "runs", run_name: str | None = None,
                 project: str = "twinkle", config: dict[str, Any] | None = None,
                 wandb_mode: str | None = None, daemon: DaemonMetrics | None = None):
        """`daemon`: where "twinkle" posts (twinkle_sdk's models pass their own)."""
        names = [report_to] if isinstance(report_to, str) else list(report_to)
        unknown = [n for n in names if n not in SINKS]
        if unknown:
            raise ValueError(f"report_to: unknown {unknown}; choose from {list(SINKS)}")
        if "twinkle" in names and daemon is None:
            raise ValueError("report_to='twinkle' posts to a daemon: it needs a model made "
                             "after init_twinkle_client(base_url, api_key)")
        self.run_name = run_name or time.strftime("%Y%m%d-%H%M%S")
        self.log_dir = Path(log_dir) / self.run_name
        self.records: list[tuple[int, dict[str, float]]] = []
        self._sinks = [daemon if n == "twinkle" else
                       _open(n, self.log_dir, self.run_name, project, config or {}, wandb_mode)
                       for n in names]

    def log(self, metrics: dict[str, float], step: int, prefix: str = "") -> None:
        """`metrics` at `step`, each name under `prefix` (e.g. "train/")."""
        record = {f"{prefix}{k}": float(v) for k, v in metrics.items()}
        self.records.append((step, record))
        for sink in self._sinks:
            sink.log(record, step)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open(name: str, log_dir: Path, run_name: str, project: str, config: dict,
          wandb_mode: str | None):
    if name == "tensorboard":
        return _TensorBoard(log_dir)
    if name == "wandb":
        return _WandB(log_dir, run_name, project, config, wandb_mode)
    return _JsonLines(log_dir / "metrics.jsonl")


class _TensorBoard:
    def __init__(self, log_dir: Path):
        writer = None
        if importlib.util.find_spec("tensorboard") is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
                writer = SummaryWriter
            except ImportError:  # tensorboard without torch: tensorboardX below
                pass
        if writer is None:
            try:
                from tensorboardX import SummaryWriter
                writer = SummaryWriter
            except ImportError:
                raise ImportError("report_to='tensorboard' needs the `tensorboard` package "
                                  "(with torch) or `tensorboardX`: pip install "
                                  "tensorboardX") from None
        self.writer = writer(str(log_dir))

    def log(self, record: dict[str, float], step: int) -> None:
        for key, value in record.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a crash or a look mid-run still sees the points

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, log_dir: Path, run_name: str, project: str, config: dict,
                 mode: str | None):
        try:
            import wandb
        except ImportError:
            raise ImportError("report_to='wandb' needs the `wandb` package: pip install "
                              "wandb") from None
        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=run_name, config=config, dir=str(log_dir),
                              mode=mode or os.environ.get("WANDB_MODE") or "offline")

    def log(self, record: dict[str, float], step: int) -> None:
        self.run.log(record, step=step)

    def close(self) -> None:
        self.run.finish()


class _JsonLines:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def log(self, record: dict[str, float], step: int) -> None:
        self.file.write(json.dumps({"step": step, "time": time.time(), **record}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class DaemonMetrics:
    """Posts each record to the daemon's run (`run_id`: its id, or a function giving it
    once the run exists), for the console's curves. A value that is not a finite number
    is left out (the daemon keeps numbers); a refusal (4xx) raises with the daemon's
    reason, as a mistake in the names would."""

    def __init__(self, base_url: str, api_key: str, run_id: str | Callable[[], str | None]):
        self.base_url, self._key, self._run = base_url.rstrip("/"), api_key, run_id

    def log(self, record: dict[str, float], step: int) -> None:
        run = self._run() if callable(self._run) else self._run
        if not run:
            raise RuntimeError("report_to='twinkle': the model has no run on the daemon yet "
                               "(add its adapter first)")
        numbers = {k: float(v) for k, v in record.items()
                   if isinstance(v, (int, float)) and math.isfinite(v)}
        if not numbers:
            return
        body = json.dumps({"points": [{"step": int(step), "metrics": numbers}]}).encode()
        req = urllib.request.Request(
            f"{self.base_url}/twinkle/v1/runs/{run}/metrics", data=body, method="POST",
            headers={"X-API-Key": self._key, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=POST_T):
                pass
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise ValueError(f"the daemon refused the metrics ({e.code}): {detail}") from None

    def close(self) -> None:
        pass
