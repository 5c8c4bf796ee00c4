"""Graceful drain of one instance (and of the router): stop taking work, finish or hand off what it holds, then exit.

Triggers: the first SIGTERM (what Kubernetes and systemd send) or ``POST /admin/drain`` (``prfaas admin drain``).
Then the instance heartbeats ``draining: true`` at once, so the router's placement gives it nothing new (the
instance still serves whatever was already on its way), and it waits until it is idle: no work request open
(decode streams, prefills) and, where it holds a store (relay; prefill in direct mode), no live blob — every blob
released by its decode or expired by TTL. Idle for ``QUIET_S`` (longer than a heartbeat round trip) or past the
deadline (``drain_timeout_ms``; store holders at least the KV TTL) → uvicorn shuts down, the lifespan deregisters
from the router and closes the store. A second SIGTERM forces the exit at once (open streams are cut; the router
resumes them on another decode instance). SIGINT keeps its old meaning: stop now, with uvicorn's short grace.

The router drains too (``attach_router``; SIGTERM, ``POST /admin/drain`` or ``prfaas admin drain-router``): new
OpenAI requests get 503 ``KV_UNAVAILABLE`` with ``Retry-After`` and ``/health`` turns 503 at once, the requests
and streams it already admitted run to their end, then it exits; a second SIGTERM forces the exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from prfaas.config import CommonConfig, Config
from prfaas.store import BlobStore

log = logging.getLogger("prfaas.drain")
QUIET_S = 1.0
ROUTER_QUIET_S = 0.2  # the router's gate refuses new work at once, so nothing can slip in while it waits
POLL_S = 0.1
_IDLE_PATHS = frozenset({"/health", "/ready", "/stats", "/metrics", "/debug/store", "/admin/drain"})


class OpenWork:
    """How many work requests are open right now (``WorkCounter`` keeps it)."""

    def __init__(self) -> None:
        self.open = 0


def instance_work(path: str) -> bool:
    """An instance's work: every request but health, stats and admin."""
    return path not in _IDLE_PATHS


def router_work(path: str) -> bool:
    """The router's work: the OpenAI API (heartbeats and admin calls are not work to finish)."""
    return path.startswith("/v1/")


class WorkCounter:
    """ASGI middleware counting open work requests (``counts`` says which paths are work), streams included:
    a streaming response counts until its last byte is sent."""

    def __init__(self, app: Any, work: OpenWork, counts: Callable[[str], bool] = instance_work) -> None:
        self.app = app
        self.work = work
        self.counts = counts

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.counts(scope["path"]):
            await self.app(scope, receive, send)
            return
        self.work.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.work.open -= 1


class Drain:
    """One instance's drain. ``begin`` is idempotent; ``server`` is set once uvicorn runs."""

    def __init__(self, deadline_s: float, idle: Callable[[], bool], announce: Callable[[], Awaitable[None]],
                 quiet_s: float = QUIET_S) -> None:
        self.deadline_s = deadline_s
        self.idle = idle
        self.announce = announce
        self.quiet_s = quiet_s
        self.server: uvicorn.Server | None = None
        self.started_at: float | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def begin(self, reason: str) -> bool:
        """Start draining (once); returns False when a drain was already under way."""
        if self.draining:
            return False
        self.started_at = time.monotonic()
        log.info("draining (%s): no new work; exit when idle or after %.0f s", reason, self.deadline_s)
        self.task = asyncio.get_running_loop().create_task(self._run())
        return True

    async def _run(self) -> None:
        await self.announce()
        assert self.started_at is not None
        quiet_since: float | None = None
        while True:
            now = time.monotonic()
            quiet_since = (quiet_since or now) if self.idle() else None
            if quiet_since is not None and now - quiet_since >= self.quiet_s:
                log.info("drained in %.1f s: nothing left in flight", now - self.started_at)
                break
            if now - self.started_at >= self.deadline_s:
                log.warning("drain deadline of %.0f s passed with work left; exiting anyway", self.deadline_s)
                break
            await asyncio.sleep(POLL_S)
        if self.server is not None:
            self.server.should_exit = True

    def force(self) -> None:
        log.warning("second SIGTERM: exiting now, without waiting for open work")
        if self.server is not None:
            self.server.should_exit = self.server.force_exit = True


class DrainingServer(uvicorn.Server):
    """uvicorn with SIGTERM meaning "drain" (the second one: exit now); SIGINT is unchanged."""

    drain: Drain

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.drain.server = self

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
        elif not self.drain.draining:
            asyncio.get_event_loop().call_soon_threadsafe(self.drain.begin, "SIGTERM")
        else:
            self._captured_signals.append(sig)  # re-raised once uvicorn has stopped: the exit status says why
            self.drain.force()


def server_class(drain: Drain) -> type[uvicorn.Server]:
    """A ``DrainingServer`` bound to ``drain`` (``http.serve`` builds the server from the class)."""
    return type("BoundDrainingServer", (DrainingServer,), {"drain": drain})


class InstanceDrain(Drain):
    """An instance's drain: idle once no work request is open and, where it holds a store (relay; prefill in
    direct mode), no blob is left — a store holder serves until every blob is released or expired, so its deadline
    is at least the KV TTL. ``install`` gives the instance's app the work counter, ``POST /admin/drain`` and
    ``GET /ready`` (503 while draining: a readiness probe, where ``/health`` stays the liveness probe)."""

    def __init__(self, config: Config, store: BlobStore | None, announce: Callable[[], Awaitable[None]]) -> None:
        deadline = config.common.drain_timeout_ms / 1e3
        if store is not None:
            deadline = max(deadline, config.store.kv_ttl_seconds + 2.0)
        super().__init__(deadline, self._idle, announce,
                         quiet_s=max(QUIET_S, 2 * config.common.heartbeat_interval_ms / 1e3))
        self.store = store
        self.work = OpenWork()

    def _idle(self) -> bool:
        return self.work.open == 0 and (self.store is None or self.store.stats().blobs == 0)

    def install(self, app: FastAPI, instance_id: str) -> None:
        app.add_middleware(WorkCounter, work=self.work)

        @app.post("/admin/drain")
        async def start_drain() -> dict[str, Any]:
            started = self.begin("admin request")
            return {"instance_id": instance_id, "draining": True, "started": started,
                    "deadline_s": self.deadline_s, "open_requests": self.work.open}

        @app.get("/ready")
        async def ready() -> JSONResponse:
            status = "draining" if self.draining else "ready"
            return JSONResponse({"status": status, "open_requests": self.work.open},
                                status_code=503 if self.draining else 200)


class RouterGate:
    """The router's side of a drain, as ASGI middleware: while draining, a new OpenAI request is answered 503
    ``KV_UNAVAILABLE`` with ``Retry-After`` (the client retries on another router) and ``/health`` is 503 (the load
    balancer's readiness probe takes the router out); requests already admitted run to their end."""

    def __init__(self, app: Any, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.drain.draining or not (
                router_work(scope["path"]) or scope["path"] == "/health"):
            await self.app(scope, receive, send)
            return
        from prfaas.errors import KVUnavailable
        from prfaas.services import http

        if scope["path"] == "/health":
            reply = JSONResponse({"ready": False, "draining": True}, status_code=503)
        else:
            reply = http.error_response(KVUnavailable("this router is draining and takes no new requests; "
                                                      "retry on another router"))
        await reply(scope, receive, send)


def attach_router(app: Any, config: CommonConfig) -> Drain:
    """Give the router its drain: the work counter over ``/v1/*``, the gate, and ``POST /admin/drain`` (answers
    ``draining``, ``started``, ``deadline_s``, ``open_requests``). Exit once no request has been open for
    ``ROUTER_QUIET_S`` (the gate refuses new ones meanwhile) or at ``drain_timeout_ms``."""
    work = OpenWork()
    deadline = config.drain_timeout_ms / 1e3

    async def announce() -> None:
        log.info("router draining: %d requests open", work.open)

    drain = Drain(deadline, lambda: work.open == 0, announce, quiet_s=ROUTER_QUIET_S)
    app.add_middleware(WorkCounter, work=work, counts=router_work)
    app.add_middleware(RouterGate, drain=drain)  # outside the counter: a refused request is no open work

    @app.post("/admin/drain")
    async def start_drain() -> dict[str, Any]:
        started = drain.begin("admin request")
        return {"draining": True, "started": started, "deadline_s": deadline, "open_requests": work.open}

    return drain
