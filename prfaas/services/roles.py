"""The instance roles as classes, each on the shared core (``prfaas.services.instance.Instance``) passed in:
``PrefillServer`` (``POST /prefill``), ``DecodeServer`` (``POST /tokenize``, ``POST /generate``) and
``RelayServer`` (no route of its own: its data plane is the core's transfer server). Each owns its app, its routes
and its load; the core supplies sockets, heartbeat, drain and shutdown.

The work behind a role's routes is a backend: the embedded engine's ``PrefillService`` / ``DecodeService``
(``build`` here), or a child vLLM server's (``prfaas.vllm.serving``, wired by ``prfaas.serve``, which sits above
this package and ``prfaas.vllm``). ``prfaas serve prefill|decode|relay`` calls ``run_role``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from prfaas.config import Config
from prfaas.errors import InvalidRequest
from prfaas.events import GenerateEvent, PrefillEvent
from prfaas.messages import GenerateRequest, PrefillRequest, TcpPeer
from prfaas.security.asgi import peer_of
from prfaas.services import http, jsonbody
from prfaas.services.instance import Instance, InstanceOptions
from prfaas.services.pool import PoolClients
from prfaas.tenancy.clusters import CLUSTER_HEADER, DEFAULT_POLICY, ClusterPolicy


class PrefillBackend(Protocol):
    def prefill(self, request: PrefillRequest, cluster: ClusterPolicy = DEFAULT_POLICY) -> AsyncIterator[PrefillEvent]:
        """NDJSON events: ``accepted``, then ``done`` or ``error``. ``cluster``: the client cluster that sent it
        (proven by ``PoolClients``), for the backend's queue order."""

    def load(self) -> dict[str, int]: ...

    def tcp_peers(self) -> list[TcpPeer]:
        """``TCP_INFO`` of the pushes this process made, per relay address (heartbeats carry it to the router)."""


class DecodeBackend(Protocol):
    async def tokenize(self, body: dict[str, Any]) -> list[int]: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        """NDJSON events: ``token`` …, then ``done`` or ``error``."""

    def load(self) -> dict[str, int]: ...

    def tcp_peers(self) -> list[TcpPeer]:
        """``TCP_INFO`` of the pulls this process made, per store address (heartbeats carry it to the router)."""


class RoleServer:
    """One role's HTTP server on ``core``: ``routes`` adds the role's own routes to ``app``, ``load`` is what
    heartbeats report. ``run`` serves until shutdown; ``close`` (idempotent) runs the core's closers."""

    def __init__(self, core: Instance) -> None:
        self.core = core
        self.app = core.build_app(self.load)
        self.routes()

    def load(self) -> dict[str, int]:
        raise NotImplementedError

    def routes(self) -> None:
        """The role's own routes (none by default)."""

    async def run(self) -> None:
        await self.core.serve(self.app)

    def close(self) -> None:
        self.core.close()


class PrefillServer(RoleServer):
    """Prefill (datacenter A): ``POST /prefill`` streams the backend's events (``accepted``, ``done``), for the
    client cluster that proves who it is and is within its quotas (``prfaas.services.pool``)."""

    def __init__(self, core: Instance, backend: PrefillBackend) -> None:
        self.backend = backend
        # refusals go to the store's access log (an instance in front of vLLM has none: they are logged only)
        self.pool = PoolClients(core.config, core.options.instance_id, core.kv._accessed if core.kv else None)
        core.closers.append(self.pool.close)
        core.tcp_peers = backend.tcp_peers
        super().__init__(core)

    def load(self) -> dict[str, int]:
        return self.backend.load()

    def routes(self) -> None:
        self.app.post("/prefill")(self.prefill)

    async def prefill(self, request: Request) -> StreamingResponse:
        """403 for a cluster that proves nothing and 429 for one over quota, both before the body is queued."""
        cluster = self.pool.identify(peer_of(dict(request.scope)), request.headers.get(CLUSTER_HEADER, ""),
                                     request.headers.get("authorization", ""))
        body = PrefillRequest.from_json(await jsonbody.read(request))
        return http.ndjson(self.pool.admitted(cluster, body, self.backend.prefill(body, cluster)))


class DecodeServer(RoleServer):
    """Decode (datacenter B): ``POST /tokenize`` (the router tokenises here) and ``POST /generate`` (tokens)."""

    def __init__(self, core: Instance, backend: DecodeBackend) -> None:
        self.backend = backend
        core.tcp_peers = backend.tcp_peers
        super().__init__(core)

    def load(self) -> dict[str, int]:
        return self.backend.load()

    def routes(self) -> None:
        self.app.post("/tokenize")(self.tokenize)
        self.app.post("/generate")(self.generate)

    async def tokenize(self, request: Request) -> dict[str, Any]:
        return {"token_ids": await self.backend.tokenize(await jsonbody.read_object(request))}

    async def generate(self, request: Request) -> StreamingResponse:
        return http.ndjson(self.backend.generate(GenerateRequest.from_json(await jsonbody.read(request))))


class RelayServer(RoleServer):
    """Relay (datacenter B): holds blobs between prefill and decode in the core's store; its load is the blobs
    held and the store's free bytes."""

    def load(self) -> dict[str, int]:
        assert self.core.store is not None, "a relay's core holds a store"
        stats = self.core.store.stats()
        return {"queue_depth": stats.blobs, "free_kv_bytes": self.core.store.budget_bytes - stats.bytes}


Build = Callable[[InstanceOptions, Config], RoleServer]


def run_role(options: InstanceOptions, config: Config, build: Build) -> None:
    """Build the role (``build``), serve it until shutdown, then close it; exits non-zero after ``Instance.fail``."""
    http.setup_logging(options.instance_id)
    server = build(options, config)
    try:
        http.run(server.run())
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it caught again once it has stopped
        if not server.core.exit_code:
            raise  # an operator's Ctrl-C ends the process as one
    finally:
        server.close()  # whatever ended the loop, the engine's child process ends with it
    if server.core.exit_code:
        raise SystemExit(server.core.exit_code)


def build(options: InstanceOptions, config: Config) -> RoleServer:
    """The relay, or a prefill or decode instance on the embedded engine (``--engine prfaas``)."""
    if options.role == "relay":
        return RelayServer(Instance(options, config, with_store=True))
    if options.role not in ("prefill", "decode"):
        raise ValueError(f"unknown role {options.role!r}")
    if options.engine != "prfaas":
        raise InvalidRequest(f"--engine must be prfaas or vllm, not {options.engine!r}")
    # torch and the model load here, in the process of a role that computes, never in a light one
    from prfaas.engine import load_engine
    from prfaas.engine.prefix_prefill import PrefixPrefill
    from prfaas.engine.prefix_records import PrefixLifecycle
    from prfaas.services.decode import DecodeService
    from prfaas.services.prefill import PrefillService

    engine = load_engine(options.model, dtype=options.dtype, device=options.device)
    core = Instance(options, config, with_store=options.role == "prefill")
    core.advertise(engine)
    prefix = PrefixPrefill.maybe(engine, config.prefill.prefix_cache_bytes, options.role,
                                 lambda: PrefixLifecycle.configured(config, options.instance_id))
    if prefix is not None:
        core.prefix_blocks = prefix.summary
        core.closers.append(prefix.cache.lifecycle.close)  # last: what is still cached ends with the process
    if options.role == "prefill":
        return PrefillServer(core, PrefillService(engine, config.prefill, config.transfer, core.store,
                                                   core.security, prefix))
    return DecodeServer(core, DecodeService(engine, config, core.security, prefix))
