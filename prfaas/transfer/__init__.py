"""The KV data plane: a chunked binary protocol over TCP (TLS when configured) between stores and their readers
and writers. See ``prfaas.transfer.protocol`` for the wire format, ``prfaas.transfer.stats`` for the congestion
signals (``link_health``), the deadline rule, the global retry cap and ``max_inflight_kv``."""

from prfaas.transfer.client import backoff, pull, push, release, stat
from prfaas.transfer.server import TransferServer
from prfaas.transfer.stats import InflightLimit, blob_deadline_s, link_health

__all__ = ["InflightLimit", "TransferServer", "backoff", "blob_deadline_s", "link_health", "pull", "push",
           "release", "stat"]
