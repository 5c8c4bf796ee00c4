"""The KV data plane: a chunked binary protocol over TCP (TLS when configured) between stores and their readers
and writers. See ``prfaas.transfer.protocol`` for the wire format."""

from prfaas.transfer.client import backoff, pull, push, release, stat
from prfaas.transfer.server import TransferServer

__all__ = ["TransferServer", "backoff", "pull", "push", "release", "stat"]
