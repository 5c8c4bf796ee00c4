"""One prefill, decode or relay process: its HTTP control app, its data plane, heartbeats, and a clean shutdown.

Lifecycle: bind sockets → load the engine (prefill, decode) → start the transfer server (when the role holds a
store) → serve HTTP and heartbeat the router → on SIGTERM: drain first (``prfaas.services.drain``), then as on
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
from typing import Any

from fastapi import FastAPI

from prfaas.config import Config
from prfaas.messages import InstanceInfo
from prfaas.obs import metrics
from prfaas.security import guards
from prfaas.security import runtime as tls_runtime
from prfaas.security.apikeys import parse_keys
from prfaas.security.registration import credential
from prfaas.services import drain, http
from prfaas.services.heartbeat import Heartbeat
from prfaas.services.kvstore import StoreRuntime
from prfaas.transfer import TransferServer
from prfaas.transfer.conn import split_address

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


class Instance:
    """Holds what every role shares; the role adds its routes to ``app`` and reports ``load()``."""

    def __init__(self, options: InstanceOptions, config: Config, with_store: bool) -> None:
        self.options = options
        self.config = config
        self.http_sock = http.bind(options.host, options.port)
        self.url = "{}://{}:{}".format(tls_runtime.scheme(), *self.http_sock.getsockname()[:2])
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
        self.load: Callable[[], dict[str, int]] = lambda: {}
        self.closers: list[Callable[[], None]] = []  # run once at shutdown, last first (an engine's child process)
        self.exit_code = 0  # non-zero once ``fail`` was called: the process exits with it, so a supervisor restarts it
        self.app = FastAPI(title=f"prfaas {options.role}", lifespan=self._lifespan)
        http.install_error_handlers(self.app)
        http.install_metrics(self.app, metrics.served(options.role, options.engine))
        self.drain = drain.attach(self)  # SIGTERM / POST /admin/drain: finish, then exit (drain.py)
        guards.protect_instance(self.app, self.kv._accessed if self.kv else None, config, options.instance_id)
        self._routes()



    def info(self) -> InstanceInfo:
        return InstanceInfo.from_json({
            "instance_id": self.options.instance_id, "role": self.options.role, "url": self.url,
            "kv_address": self.kv_address, "datacenter": self.config.datacenter, "fingerprint": self.fingerprint,
            "model": self.model, "model_root": self.model_root, "max_seq_len": self.max_seq_len,
            "draining": self.drain.draining,
            "config_hash": self.config.digest(), **self.load()})

    async def run(self) -> None:
        await http.serve(self.app, self.http_sock, ssl=tls_runtime.server_ssl(),
                         server_class=drain.server_class(self.drain))

    def _routes(self) -> None:
        @self.app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "pid": os.getpid(), **self.info().to_json()}

        @self.app.get("/stats")
        async def stats() -> dict[str, Any]:
            if self.kv is None:
                return {"store": None, "records": []}
            return self.kv.stats()

        @self.app.get("/debug/store")
        async def debug_store() -> dict[str, Any]:
            return self.kv.debug() if self.kv else {"backend": None, "blobs": []}

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        server = await self._start_transfer()
        sweeper = asyncio.create_task(self._sweep()) if self.store else None
        beat = Heartbeat(self.options.router_url, self.info, self.config.heartbeat_interval_ms / 1e3,
                         on_refused=self._refused,
                         headers=credential(parse_keys(self.config.api_keys), self.options.role))
        self.beat = beat  # the drain restarts it to announce itself at once
        beat.start()
        log.info("%s %s serving on %s (kv %s)", self.options.role, self.options.instance_id, self.url,
                 self.kv_address or "-")
        try:
            yield
        finally:
            await beat.stop(deregister=True)
            if sweeper:
                sweeper.cancel()
                await asyncio.gather(sweeper, return_exceptions=True)
            if server:
                await server.close()
            if self.kv:
                left = self.kv.close()
                log.info("store closed: %d blobs ended at shutdown", len(left))
            self.close()

    def close(self) -> None:
        """Run the closers (idempotent: also called when the process ends without a lifespan)."""
        while self.closers:
            self.closers.pop()()

    async def _start_transfer(self) -> TransferServer | None:
        if self.kv is None or self.kv_sock is None:
            return None
        host, port = self.kv_sock.getsockname()[:2]
        self.kv_sock.close()  # the transfer server binds the same port itself
        server = self.kv.server(host, port)
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
