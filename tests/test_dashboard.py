"""ops/grafana-dashboard.json queries only metrics the daemon's /metrics exports, so the
dashboard cannot rot when a metric is renamed or dropped."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parent.parent / "ops" / "grafana-dashboard.json"
# The series a family of each type writes (the parser names counters without `_total`).
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "untyped": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created")}


def queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panels' targets and query variables."""
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            out.append(v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
    return out


def test_every_metric_the_dashboard_queries_is_exported(daemon):
    with urllib.request.urlopen(f"{daemon.url}/metrics", timeout=30) as r:
        families = list(text_string_to_metric_families(r.read().decode()))
    exported = {f.name + s for f in families for s in SUFFIXES[f.type]}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = queries(dashboard)
    used = {m for e in exprs for m in re.findall(r"\btwinkle_[a-z_]+", e)}
    assert len(exprs) >= 20 and len(used) >= 15, "the dashboard lost its panels"
    assert not used - exported, f"the dashboard queries metrics /metrics lacks: {used - exported}"
    # Each panel reads the data source the importer picks, not a uid of one install.
    assert {t["datasource"]["uid"] for p in dashboard["panels"]
            for t in p.get("targets", ())} == {"${datasource}"}
