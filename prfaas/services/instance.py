"""The core every instance role is built on (``Instance``): its sockets, its data plane (when it holds a store),
heartbeats, the drain and a clean shutdown. A role class (``prfaas.services.roles``: ``PrefillServer``,
``DecodeServer``, ``RelayServer``) gets the core passed in, builds its HTTP app with ``build_app`` (which installs
what every role shares: error handlers, metrics, the drain, the guards, ``/health``, ``/stats``, ``/debug/store``)
and adds its own routes.

Lifecycle: bind sockets → load the engine (prefill, decode) → start the transfer server (when the role holds a
store) → serve HTTP and heartbeat the router (each router, for a prefill pool with several client clusters) →
on SIGTERM: drain first (``prfaas.services.drain``), then as on
SIGINT: deregister, let uvicorn drain open requests,
close the transfer server, close the store (every blob left gets a ``shutdown`` deletion record, and the audit log a
``close`` entry). The store, its backend, audit log and metrics are ``prfaas.services.kvstore.StoreRuntime``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from prfaas.config import Config
from prfaas.messages import InstanceInfo, TcpPeer
from prfaas.obs import metrics
from prfaas.security import guards
from prfaas.security.apikeys import parse_keys
from prfaas.security.registration import credential
from prfaas.security.runtime import Security
from prfaas.services import drain, http
from prfaas.services.drain import InstanceDrain
from prfaas.services.heartbeat import Heartbeat
from prfaas.services.kvstore import StoreRuntime
from prfaas.transfer import TransferServer
from prfaas.transfer.conn import split_address

if TYPE_CHECKING:  # the protocol's name only: importing prfaas.engine at run time loads torch
    from prfaas.engine.protocol import EngineInfo

log = logging.getLogger("prfaas.instance")
SWEEP_INTERVAL_S = 1.0


@dataclass(frozen=True)
class InstanceOptions:
    role: str
    instance_id: str
    router_url: str
    host: str = "127.0.0.1"
    port: int = 0
    kv_port: int = 0
    model: str = ""
    advertise_kv: str = ""  # HOST:PORT peers dial for the KV data port (NAT, load balancer); "" = the bound one
    dtype: str = "float32"
    engine: str = "prfaas"  # prfaas (the embedded engine) | vllm (a child vLLM server: prfaas.vllm.serving)
    device: str = "cpu"  # where the embedded engine runs (cpu, cuda, cuda:N, auto)
    routers: tuple[str, ...] = ()  # more routers to register with: a prefill pool serving several client clusters

    def router_urls(self) -> tuple[str, ...]:
        """Every router this instance registers and heartbeats with, ``router_url`` first, each once."""
        return tuple(dict.fromkeys(u.rstrip("/") for u in (self.router_url, *self.routers) if u))


Load = Callable[[], dict[str, int]]  # a role's load for heartbeats: queue_depth, free_kv_bytes, …


class Instance:
    """What every role shares. The role fills in what its engine advertises (``fingerprint``, ``model``,
    ``max_seq_len``, ``model_root``, ``kv_address`` where another process serves KV) and adds ``closers``."""

    def __init__(self, options: InstanceOptions, config: Config, with_store: bool) -> None:
        self.options = options
        self.config = config
        self.config_hash = config.digest()  # the config is frozen: hashed once, not in every heartbeat
        self.security = Security.of(config, options.role)  # the role's TLS, checked before anything binds
        self.http_sock = http.bind(options.host, options.port)
        self.url = "{}://{}:{}".format(self.security.scheme(), *self.http_sock.getsockname()[:2])
        self.kv_sock = http.bind(options.host, options.kv_port) if with_store else None
        if options.advertise_kv:
            split_address(options.advertise_kv)  # InvalidRequest at start, not when a peer dials it
        bound = "{}:{}".format(*self.kv_sock.getsockname()[:2]) if self.kv_sock else ""
        self.kv_address = options.advertise_kv or bound if self.kv_sock else ""
        self.kv = StoreRuntime(config, options.instance_id) if with_store else None
        self.store = self.kv.store if self.kv else None
        self.fingerprint: dict[str, Any] = {}
        self.model, self.max_seq_len = options.model, 0
        self.model_root = ""  # where the engine's tokenizer loads from (InstanceInfo.model_root)
        self.closers: list[Callable[[], None]] = []  # run once at shutdown, last first (an engine's child process)
        self.exit_code = 0  # non-zero once ``fail`` was called: the process exits with it, so a supervisor restarts it
        self.drain = InstanceDrain(config, self.store, self._announce)  # SIGTERM / POST /admin/drain (drain.py)
        self.beats: list[Heartbeat] = []  # one per router, running while the app serves (its lifespan)
        self._load: Load = dict  # no role yet, no load to report (``build_app`` sets the role's)
        # held prefix blocks for heartbeats: the engine's prefix cache's summary where it has one (roles.build)
        self.prefix_blocks: Callable[[], list[str]] = list
        # the role's data-plane TCP figures per peer address (InstanceInfo.tcp_peers): none unless the role has some
        self.tcp_peers: Callable[[], list[TcpPeer]] = list

    def advertise(self, engine: EngineInfo) -> None:
        """What heartbeats say of the engine this instance serves: fingerprint, model, context, tokenizer root."""
        self.fingerprint = engine.fingerprint.to_wire()
        self.model, self.max_seq_len = engine.name, engine.max_seq_len
        self.model_root = engine.root

    def build_app(self, load: Load) -> FastAPI:
        """The role's app, with what every role shares and this core's lifespan; ``load`` is the role's load,
        sent in each heartbeat. Once per core: the app's lifespan runs this core's heartbeat and data plane."""
        self._load = load
        app = FastAPI(title=f"prfaas {self.options.role}", lifespan=self._lifespan)
        http.install_error_handlers(app)
        http.install_metrics(app, metrics.served(self.options.role, self.options.engine))
        self.drain.install(app, self.options.instance_id)  # finish, then exit (drain.py)
        guards.protect_instance(app, self.kv._accessed if self.kv else None, self.config, self.options.instance_id,
                                self.security)
        self._routes(app)
        return app

    def info(self) -> InstanceInfo:
        return InstanceInfo.from_json({
            "instance_id": self.options.instance_id, "role": self.options.role, "url": self.url,
            "kv_address": self.kv_address, "datacenter": self.config.common.datacenter, "fingerprint": self.fingerprint,
            "model": self.model, "model_root": self.model_root, "max_seq_len": self.max_seq_len,
            "draining": self.drain.draining,
            "config_hash": self.config_hash, "prefix_blocks": self.prefix_blocks(),
            "tcp_peers": self.tcp_peers(), **self._load()})

    async def serve(self, app: FastAPI) -> None:
        """Serve ``app`` (from ``build_app``) on this core's socket until shutdown; SIGTERM drains first."""
        await http.serve(app, self.http_sock, ssl=self.security.server_ssl(),
                         server_class=drain.server_class(self.drain))

    def _routes(self, app: FastAPI) -> None:
        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "pid": os.getpid(), **self.info().to_json()}

        @app.get("/stats")
        async def stats() -> dict[str, Any]:
            if self.kv is None:
                return {"store": None, "records": []}
            return self.kv.stats()

        @app.get("/debug/store")
        async def debug_store() -> dict[str, Any]:
            return self.kv.debug() if self.kv else {"backend": None, "blobs": []}

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        server = await self._start_transfer()
        sweeper = asyncio.create_task(self._sweep()) if self.store else None
        headers = credential(parse_keys(self.config.common.api_keys), self.options.role)
        self.beats = [Heartbeat(url, self.info, self.config.common.heartbeat_interval_ms / 1e3,
                                on_refused=self._refused, headers=headers, verify=self.security.http_verify())
                      for url in self.options.router_urls()]
        for beat in self.beats:
            beat.start()
        log.info("%s %s serving on %s (kv %s)", self.options.role, self.options.instance_id, self.url,
                 self.kv_address or "-")
        try:
            yield
        finally:
            await asyncio.gather(*(beat.stop(deregister=True) for beat in self.beats))
            if sweeper:
                sweeper.cancel()
                await asyncio.gather(sweeper, return_exceptions=True)
            if server:
                await server.close()
            if self.kv:
                left = self.kv.close()
                log.info("store closed: %d blobs ended at shutdown", len(left))
            self.close()

    async def _announce(self) -> None:
        """The drain has begun: restart the heartbeats, whose first beat, at once, tells each router it drains."""
        for beat in self.beats:
            await beat.stop(deregister=False)
            beat.start()

    def close(self) -> None:
        """Run the closers (idempotent: also called when the process ends without a lifespan)."""
        while self.closers:
            self.closers.pop()()

    async def _start_transfer(self) -> TransferServer | None:
        if self.kv is None or self.kv_sock is None:
            return None
        host, port = self.kv_sock.getsockname()[:2]
        self.kv_sock.close()  # the transfer server binds the same port itself
        server = self.kv.server(host, port, self.security)
        await server.start()
        return server

    async def _sweep(self) -> None:
        assert self.kv is not None
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.kv.sweep()

    def fail(self, reason: str) -> None:
        """Something this instance cannot serve without has gone (its engine's process): stop now, deregistered,
        and exit non-zero (``run_role``), so that ``prfaas up`` or systemd starts it again. Any thread may call it."""
        log.error("this instance stops: %s", reason)
        self.exit_code = 1
        os.kill(os.getpid(), signal.SIGINT)

    @staticmethod
    def _refused(reason: str) -> None:
        """The router will not pair us (another model): say why and stop, rather than idle unregistered."""
        log.error("the router refused this instance and it stops: %s", reason)
        os.kill(os.getpid(), signal.SIGINT)  # stop now: it holds no work, so nothing to drain
