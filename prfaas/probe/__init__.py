"""Link measurement between two hosts: ``prfaas probe serve`` on one, ``prfaas probe run`` on the other.

Bulk TCP bandwidth over several streams after a warm-up, RTT P50/P99 and jitter over a TCP echo, loss with a
UDP probe train (round trip), path MTU from the kernel (``IP_MTU``) checked with don't-fragment datagrams.
"""

from __future__ import annotations

from prfaas.probe.client import ProbeResult, run_probe
from prfaas.probe.server import ProbeServer

__all__ = ["ProbeResult", "ProbeServer", "run_probe"]
