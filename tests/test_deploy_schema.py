"""The Kubernetes manifests validated offline against the Kubernetes API schemas (the ``kubernetes-validate``
package, which ships them), strictly: an unknown or misplaced field fails. No cluster is needed."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed "
                                          "(pip install -e '.[dev]')")
MANIFESTS = sorted((Path(__file__).resolve().parent.parent / "deploy" / "k8s").glob("*/*.yaml"))


def _resources() -> list[dict[str, Any]]:
    return [d for f in MANIFESTS for d in yaml.safe_load_all(f.read_text()) if d]


def _validate(resource: dict[str, Any]) -> None:
    kubernetes_validate.validate(resource, kubernetes_validate.latest_version(), strict=True)


def test_every_manifest_matches_the_kubernetes_schema() -> None:
    resources = _resources()
    assert {r["kind"] for r in resources} >= {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap"}
    for resource in resources:
        _validate(resource)


def test_the_validator_catches_a_planted_mistake() -> None:
    router = next(r for r in _resources() if r["kind"] == "Deployment" and r["metadata"]["name"] == "prfaas-router")
    wrong = copy.deepcopy(router)
    wrong["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = 8000  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(wrong)
    wrong = copy.deepcopy(router)
    wrong["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(wrong)
