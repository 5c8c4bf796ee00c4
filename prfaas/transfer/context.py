"""``TransferContext``: what one role's data plane shares, made once when the role starts and passed to every
``pull`` and ``push`` it makes. Nothing of it is process-wide: two roles in one process (tests, the vLLM
connector beside prfaas) each have their own.

| field        | what                                                            | without a context (tests, tools) |
|--------------|-----------------------------------------------------------------|----------------------------------|
| ``limits``   | wire limits every frame read is checked against (``limits``)   | ``prfaas.limits.DEFAULT``        |
| ``client_ssl`` | TLS context of outgoing data-plane connections                | None: plaintext                  |
| ``inflight`` | ``max_inflight_kv``: blobs in flight at once (back-pressure)    | None: unbounded                  |
| ``arenas``   | the reused payload arenas of pulls (``buffers.ArenaPool``)      | a pool of ``POOL_BLOBS``         |
| ``verify``   | the worker threads that verify pulled chunks                    | None: the loop's default executor |
| ``stats``    | congestion signals and the retry cap (``stats.LinkRecorder``s)  | fresh recorders                  |

The context is frozen: the objects it holds keep their own state (a pool's arenas, a recorder's window), but no
field is ever replaced, so every pull and push of a role sees the same ones. A call made without a context gets a
fresh one of its own: its retry cap and arenas then cover that call only. ``for_role`` builds a role's from its
config; ``close`` stops its verify threads. The role's ``TransferServer`` checks frames against its store's limits
(``BlobStore(limits=…)``), the same ``config.limits``.
"""

from __future__ import annotations

import ssl as ssl_module
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

from prfaas.limits import DEFAULT, WireLimits
from prfaas.transfer.buffers import ArenaPool
from prfaas.transfer.stats import InflightLimit, LinkRecorder

POOL_BLOBS = 4  # arenas kept for pulls without a ``max_inflight_kv`` limit
VERIFY_WORKERS = 2  # chunk verification threads per role: xxHash64 releases the GIL, two keep up with the wire


@dataclass(frozen=True)
class TransferStats:
    """One role's link recorders, one per direction."""

    pull: LinkRecorder = field(default_factory=lambda: LinkRecorder("pull"))
    push: LinkRecorder = field(default_factory=lambda: LinkRecorder("push"))


@dataclass(frozen=True)
class TransferContext:
    """A role's data-plane context (module docstring)."""

    limits: WireLimits = DEFAULT
    client_ssl: ssl_module.SSLContext | None = None
    inflight: InflightLimit | None = None
    arenas: ArenaPool = field(default_factory=lambda: ArenaPool(POOL_BLOBS))
    verify: Executor | None = None
    stats: TransferStats = field(default_factory=TransferStats)

    @classmethod
    def for_role(cls, limits: WireLimits, client_ssl: ssl_module.SSLContext | None,
                 max_inflight_kv: int) -> TransferContext:
        """A role's context: its limits and client TLS, ``max_inflight_kv`` blobs in flight (and as many arenas),
        its own verify threads (``close`` stops them). ``max_inflight_kv`` 0 leaves pulls unbounded."""
        inflight = InflightLimit(max_inflight_kv) if max_inflight_kv > 0 else None
        return cls(limits=limits, client_ssl=client_ssl, inflight=inflight,
                   arenas=ArenaPool(max_inflight_kv if max_inflight_kv > 0 else POOL_BLOBS),
                   verify=ThreadPoolExecutor(VERIFY_WORKERS, thread_name_prefix="prfaas-verify"))

    def close(self) -> None:
        """Stop the verify threads (running jobs finish); the arenas are freed as their users drop them."""
        if self.verify is not None:
            self.verify.shutdown(wait=False)
