"""Deletion proofs and access audit: hash-chained JSON-lines logs written by every store (``AuditLog``), checked
by ``verify`` and questioned by ``prfaas.audit.report`` (``prfaas audit verify|report``)."""

from prfaas.audit.chain import ChainLog
from prfaas.audit.log import AuditLog
from prfaas.audit.verify import Verdict, verify

__all__ = ["AuditLog", "ChainLog", "Verdict", "verify"]
