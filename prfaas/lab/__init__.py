"""Two datacenters on one Linux host: namespaces ``dc-a`` (prefill) and ``dc-b`` (router, relay, decode) joined by a
veth WAN with rate, delay, jitter, loss, MTU and cuts. ``Lab`` is the API; ``prfaas lab`` the command line."""

from __future__ import annotations

from prfaas.lab.lab import Lab
from prfaas.lab.spec import LinkSettings, Topology
from prfaas.lab.system import missing_support

__all__ = ["Lab", "LinkSettings", "Topology", "missing_support"]
