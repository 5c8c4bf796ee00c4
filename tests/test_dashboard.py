"""The Grafana dashboard only queries metrics that prfaas defines."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prfaas.obs import metrics

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana-prfaas.json"


def test_dashboard_queries_defined_metrics() -> None:
    defined = metrics.names()
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|total|count|sum)$", "", name) for e in exprs for name in re.findall(r"prfaas_\w+", e)}
    assert used and used <= defined | {n.removesuffix("_total") for n in defined}, used - defined
