"""The KV data plane: a chunked binary protocol over TCP (TLS when configured) between stores and their readers
and writers. See ``prfaas.transfer.protocol`` for the wire format, ``prfaas.transfer.context`` for what a role's
pulls and pushes share, ``prfaas.transfer.stats`` for the congestion signals (``LinkRecorder.health``), the
deadline rule, the retry cap and ``max_inflight_kv``."""

from prfaas.transfer.client import backoff, pull, push, release, stat
from prfaas.transfer.context import TransferContext
from prfaas.transfer.server import TransferServer
from prfaas.transfer.stats import InflightLimit, blob_deadline_s

__all__ = ["InflightLimit", "TransferContext", "TransferServer", "backoff", "blob_deadline_s", "pull", "push",
           "release", "stat"]
