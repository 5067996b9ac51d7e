"""tinker-cookbook's metrics on the daemon's web console: a `ml_log.Logger` that posts what
the cookbook's training loops log (reward means, KL, eval scores, ...) to the run on the
daemon (twinkle_sdk.tracking.DaemonMetrics), beside the JSON / W&B loggers it already has:

    from tinker_cookbook.utils import ml_log
    from twinkle_sdk.cookbook_log import TwinkleMetricsLogger

    logger = ml_log.setup_logging(log_dir, wandb_project=None)
    logger.loggers.append(TwinkleMetricsLogger(base_url, api_key,
                                               run_id=lambda: training_client.model_id))

Importing this module needs tinker-cookbook installed; nothing else in twinkle_sdk does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tinker_cookbook.utils import ml_log

from .tracking import DaemonMetrics


class TwinkleMetricsLogger(ml_log.Logger):
    """Each `log_metrics(metrics, step)` to the run's console curves; values that are not
    numbers (texts, tables) are left out, as a step-less call is (a curve needs a step)."""

    def __init__(self, base_url: str, api_key: str,
                 run_id: str | Callable[[], str | None]):
        self._daemon = DaemonMetrics(base_url, api_key, run_id)

    def log_hparams(self, config: Any) -> None:
        """Hyperparameters are the run's, not a curve's: the console shows its config."""

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if step is not None:
            self._daemon.log(metrics, step)
