"""The deployment manifests in deploy/ are well-formed and carry what operations rely on: readiness from the
instances' /ready (503 while draining), liveness from /health, a preStop drain, grace periods longer than the
drain, PodDisruptionBudgets, resource requests; systemd units stop with SIGTERM after a long enough wait.
(No cluster here: a structural check of the fields that matter, not a full Kubernetes schema validation.)"""

from __future__ import annotations

from pathlib import Path

import yaml

from prfaas.config import load_config

DEPLOY = Path(__file__).parent.parent / "deploy"


def _docs() -> list[dict]:
    return [d for f in sorted((DEPLOY / "k8s").glob("*/*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def test_every_role_is_deployed_with_probes_drain_budget_and_resources() -> None:
    docs = _docs()
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == {"prfaas-router", "prfaas-prefill", "prfaas-decode", "prfaas-relay"}
    budgets = {d["metadata"]["name"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    config = load_config(DEPLOY / "prfaas.example.yaml")
    for name, dep in deployments.items():
        assert dep["apiVersion"] == "apps/v1"
        pod = dep["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        if name == "prfaas-router":
            continue
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert "/admin/drain" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
        assert pod["terminationGracePeriodSeconds"] > config.drain_timeout_ms / 1e3
        assert name in budgets
    for name in ("prfaas-prefill", "prfaas-relay"):  # store holders wait for their blobs' TTL
        assert deployments[name]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > config.kv_ttl_seconds


def test_systemd_units_stop_with_sigterm_and_wait_for_the_drain() -> None:
    units = sorted((DEPLOY / "systemd").glob("prfaas-*.service"))
    assert [u.stem for u in units] == ["prfaas-decode", "prfaas-prefill", "prfaas-relay", "prfaas-router"]
    for unit in units:
        fields = dict(line.split("=", 1) for line in unit.read_text().splitlines() if "=" in line
                      and not line.startswith("#"))
        assert fields["KillSignal"] == "SIGTERM" and "prfaas serve" in fields["ExecStart"]
        assert int(fields["TimeoutStopSec"]) > 60
