"""What `GET /metrics` reports, in Prometheus text format (prometheus_client).

One registry per daemon. The service counts tokens as steps finish and times steps and
queue waits; gauges (queue depth, adapters, GPU memory) are read from the live state at
scrape time, so they are never stale.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120)


class Metrics:
    def __init__(self, service: Any):
        self.registry = r = CollectorRegistry()
        self.tokens_trained = Counter("twinkle_tokens_trained", "Tokens of forward/backward "
                                      "rows run, per tenant", ["tenant"], registry=r)
        self.tokens_sampled = Counter("twinkle_tokens_sampled", "Tokens generated, per tenant",
                                      ["tenant"], registry=r)
        self.prompt_tokens = Counter("twinkle_prompt_tokens", "Prompt tokens of sampling "
                                     "requests, per tenant, by source: cached (the prefix "
                                     "cache had their keys and values) or prefilled",
                                     ["tenant", "source"], registry=r)
        self.requests = Counter("twinkle_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.step_seconds = Histogram("twinkle_step_seconds", "Time of one engine step on the "
                                      "workers, by kind", ["kind"], buckets=_STEP_BUCKETS,
                                      registry=r)
        self.queue_wait = Histogram("twinkle_queue_wait_seconds", "Time from submit to the "
                                    "start of the step that runs it", buckets=_WAIT_BUCKETS,
                                    registry=r)
        self.gather_wait = Histogram("twinkle_gather_wait_seconds", "Time the loop waited "
                                     "after a step for its clients' next requests (gather_ms)",
                                     buckets=_WAIT_BUCKETS, registry=r)
        self.samples_cancelled = Counter("twinkle_samples_cancelled", "Samples taken out of "
                                         "the queue or the running batches because their "
                                         "client went away, per tenant", ["tenant"],
                                         registry=r)
        self.worker_restarts = Counter("twinkle_worker_restarts", "Worker group restarts "
                                       "after a fault", registry=r)
        r.register(_Live(service))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Live:
    """Gauges read from the service at scrape time."""

    def __init__(self, service: Any):
        self.service = service

    def collect(self):
        g = self.service.life.gauges()
        depth = GaugeMetricFamily("twinkle_queue_depth", "Requests queued (or held back by "
                                  "quota), per tenant", labels=["tenant"])
        for name, n in g["queued"].items():
            depth.add_metric([name], n)
        yield depth
        yield GaugeMetricFamily("twinkle_adapters_loaded", "Training adapters loaded",
                                value=g["adapters"])
        for name, what, key in (
                ("twinkle_gpu_memory_bytes", "Device memory allocated by the engine after "
                 "the last step, per worker rank", "memory_bytes"),
                ("twinkle_gpu_peak_memory_bytes", "The most device memory the engine has "
                 "allocated since the worker started, per worker rank", "peak_memory_bytes")):
            memory = GaugeMetricFamily(name, what, labels=["lane", "rank", "device"])
            for w in g["workers"]:
                memory.add_metric([str(w["lane"]), str(w["rank"]), w["device"]], w.get(key, 0))
            yield memory
        busy = CounterMetricFamily("twinkle_worker_busy_seconds", "Time each worker rank spent "
                                   "running steps since the group (re)started; against wall "
                                   "time, how busy the rank is",
                                   labels=["lane", "rank", "device"])
        for w in g["workers"]:
            busy.add_metric([str(w["lane"]), str(w["rank"]), w["device"]], w.get("busy_s", 0.0))
        yield busy
        alive = GaugeMetricFamily("twinkle_worker_up", "1 when the worker rank runs, with the "
                                  "host it runs on (a lane of another host is down while that "
                                  "host is gone)", labels=["lane", "rank", "device", "host"])
        for w in g["workers"]:
            alive.add_metric([str(w["lane"]), str(w["rank"]), w["device"], w.get("host", "")],
                             1.0 if w.get("alive") else 0.0)
        yield alive
        yield GaugeMetricFamily("twinkle_up", "1 when the daemon serves requests now",
                                value=1.0 if g["up"] else 0.0)
        yield from _gap_metrics(g["logprob_gap"])
        yield from _tier_metrics(g["tiers"])


def _tier_metrics(tiers: dict):
    """Adapter residency (core/tiers.py): where adapters are, what moved, prefetches."""
    where = GaugeMetricFamily("twinkle_adapters_resident", "Training adapters per residency "
                              "tier (gpu: in a lane's bank; host: parked in host memory)",
                              labels=["tier"])
    for tier in ("gpu", "host"):
        where.add_metric([tier], tiers[tier])
    yield where
    moves = CounterMetricFamily("twinkle_adapter_moves", "Adapter moves between the residency "
                                "tiers, by kind (to_host, to_disk, from_host, from_disk)",
                                labels=["kind"])
    for kind in ("to_host", "to_disk", "from_host", "from_disk"):
        moves.add_metric([kind], tiers["moves"].get(kind, 0))
    yield moves
    yield CounterMetricFamily("twinkle_adapter_moved_bytes", "Bytes of adapter state moved "
                              "between the residency tiers", value=tiers["moved_bytes"])
    prefetch = CounterMetricFamily("twinkle_adapter_prefetch", "Adapters brought into the GPU "
                                   "bank: hit (inside the step in flight, or with no other "
                                   "work waiting) or miss (a step waited for the move)",
                                   labels=["result"])
    for label, key in (("hit", "hits"), ("miss", "misses")):
        prefetch.add_metric([label], tiers["prefetch"][key])
    yield prefetch
    yield CounterMetricFamily("twinkle_adapter_churn", "Adapters parked out of the GPU bank "
                              "within 10 s of their last use: the runs training at once do "
                              "not fit it", value=tiers["churn"])
    yield CounterMetricFamily("twinkle_runs_started_parked", "New runs the GPU bank had no "
                              "room for, started parked on disk (made from their seed on "
                              "their first request)", value=tiers["started_parked"])


def _gap_metrics(gap: dict):
    """The sampler's logprobs against the trainer's for the same tokens (workers/gaps.py):
    no sample of the window, no value (not a 0 that would read as a perfect match)."""
    for key, what in (("mean", "Mean |sampler - trainer| logprob per generated token, "
                               "nats, over the recently checked samples"),
                      ("max", "Largest |sampler - trainer| logprob of one generated token, "
                              "nats, over the recently checked samples")):
        family = GaugeMetricFamily(f"twinkle_logprob_gap_{key}_nats", what)
        if gap[key] is not None:
            family.add_metric([], gap[key])
        yield family
    yield GaugeMetricFamily("twinkle_logprob_gap_window", "Checked samples the logprob gap "
                            "figures are over", value=gap["window"])
    yield CounterMetricFamily("twinkle_logprob_gap_checks", "Samples scored again by the "
                              "training forward (1 in logprob_gap_every)",
                              value=gap["checked"])
