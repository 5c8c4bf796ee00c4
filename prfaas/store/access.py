"""Who is accessing the store, and for what: a context variable set by whoever knows.

The data-plane server sets the authenticated peer for each connection (``prfaas.services.dataplane``); a local
writer (direct-mode prefill) may set the request id as the purpose. ``tenant`` is whose blob a ``create`` makes
(the blob keeps it for every later record). The store reads it for every access record;
with nothing set, the store's own owner id is recorded as ``who``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Accessor:
    who: str = ""
    purpose: str = ""
    tenant: str = ""


CURRENT: contextvars.ContextVar[Accessor] = contextvars.ContextVar("prfaas_store_accessor", default=Accessor())  # noqa: B039 (frozen)


@contextlib.contextmanager
def accessing(who: str | None = None, purpose: str | None = None,
              tenant: str | None = None) -> Iterator[Accessor]:
    """Within this block (and the tasks it starts), store accesses are recorded as ``who`` for ``purpose``;
    a ``None`` keeps what an outer block set."""
    outer = CURRENT.get()
    accessor = Accessor(outer.who if who is None else who, outer.purpose if purpose is None else purpose,
                        outer.tenant if tenant is None else tenant)
    token = CURRENT.set(accessor)
    try:
        yield accessor
    finally:
        CURRENT.reset(token)


def current() -> Accessor:
    return CURRENT.get()
