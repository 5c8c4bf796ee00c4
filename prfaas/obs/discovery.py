"""Prometheus HTTP service discovery: the router's ``GET /admin/prometheus/targets`` lists every process to scrape.

The body is Prometheus's own ``http_sd_configs`` format, one target group per process (each has its own labels)::

    [{"targets": ["127.0.0.1:40123"],
      "labels": {"__scheme__": "http", "__metrics_path__": "/metrics",
                 "prfaas_role": "decode", "prfaas_instance_id": "decode-0", "prfaas_datacenter": "dc-b"}}]

The router itself comes first, then every registered instance (prefill, decode, relay) at the address it
registered, healthy or not: a silent instance shows as ``up == 0`` instead of vanishing. Under ``prfaas up`` every
instance binds a random port and a restart binds another; the next refresh of the discovery follows it. The labels
are prefixed because ``role`` and ``datacenter`` are also labels of prfaas series (``prfaas_registry_instances``,
``prfaas_tenant_kv_byte_seconds_total``), which a target label of the same name would rename to ``exported_*``.
An empty datacenter is left out (Prometheus drops empty labels anyway).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prfaas.messages import InstanceInfo

METRICS_PATH = "/metrics"


@dataclass(frozen=True)
class Target:
    """One process to scrape: ``address`` is ``host:port`` (IPv6 hosts in brackets), ``scheme`` http or https."""

    address: str
    scheme: str
    role: str
    instance_id: str
    datacenter: str = ""

    @classmethod
    def of_instance(cls, info: InstanceInfo) -> Target:
        url = urlsplit(info.url)
        return cls(url.netloc, url.scheme or "http", info.role, info.instance_id, info.datacenter)

    def to_json(self) -> dict[str, Any]:
        labels = {"__scheme__": self.scheme, "__metrics_path__": METRICS_PATH, "prfaas_role": self.role,
                  "prfaas_instance_id": self.instance_id}
        if self.datacenter:
            labels["prfaas_datacenter"] = self.datacenter
        return {"targets": [self.address], "labels": labels}


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def target_groups(router: Target, instances: Iterable[InstanceInfo]) -> list[dict[str, Any]]:
    """The discovery body: the router, then each instance in registration order."""
    return [router.to_json(), *(Target.of_instance(info).to_json() for info in instances)]
