"""Instance side of the registry: register with the router, then heartbeat with fresh load figures."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from prfaas.messages import InstanceInfo
from prfaas.security import runtime as tls_runtime

log = logging.getLogger("prfaas.heartbeat")


class Heartbeat:
    """Sends ``info()`` to ``router_url`` every ``interval_s``; failures are logged and retried, never fatal
    (the router marks us unhealthy if it stops hearing from us, and we re-register when it comes back)."""

    def __init__(self, router_url: str, info: Callable[[], InstanceInfo], interval_s: float,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.router_url = router_url.rstrip("/")
        self.info = info
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self.refused: str | None = None
        self.on_refused = on_refused

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self, deregister: bool = True) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if deregister:
            try:
                async with httpx.AsyncClient(timeout=2.0, verify=tls_runtime.http_verify()) as client:
                    await client.post(f"{self.router_url}/internal/deregister",
                                      json={"instance_id": self.info().instance_id})
            except httpx.HTTPError:
                pass

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=max(1.0, self.interval_s * 2),
                                     verify=tls_runtime.http_verify()) as client:
            while True:
                try:
                    reply = await client.post(f"{self.router_url}/internal/heartbeat", json=self.info().to_json())
                    if reply.status_code == 409:
                        self.refused = reply.json().get("error", {}).get("message", "refused")
                        if self.on_refused:
                            self.on_refused(self.refused)
                            return
                except httpx.HTTPError as exc:
                    log.debug("heartbeat to %s failed: %s", self.router_url, exc)
                await asyncio.sleep(self.interval_s)
