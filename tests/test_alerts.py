"""The alert rules in deploy/ use only metrics that prfaas defines, and fire on recorded samples (promtool)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from prfaas.obs import metrics

RULES = Path(__file__).parent.parent / "deploy" / "prometheus"
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def test_every_metric_in_the_rules_exists() -> None:
    rules = yaml.safe_load((RULES / "alerts.yml").read_text())["groups"][0]["rules"]
    used = {name for rule in rules for name in re.findall(r"prfaas_[a-z0-9_]+", rule["expr"])}
    defined = metrics.names()
    missing = sorted(n for n in used if n not in defined and not any(n.removesuffix(s) in defined for s in
                                                                       _SUFFIXES))
    assert not missing, f"alert rules use metrics that prfaas/obs/metrics.py does not define: {missing}"
    assert len(rules) >= 10


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus; "
                    "scripts/install-system-deps.sh installs it)")
def test_the_prometheus_config_and_its_rules_load() -> None:
    result = subprocess.run(["promtool", "check", "config", "prometheus.yml"], cwd=RULES, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout, result.stdout


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (Debian package prometheus; "
                    "scripts/install-system-deps.sh installs it)")
def test_rules_fire_on_recorded_samples() -> None:
    result = subprocess.run(["promtool", "test", "rules", "alerts_test.yml"], cwd=RULES, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
