"""Instance side of the registry: register with the router, then heartbeat with fresh load figures.

Without a certificate the router knows an instance by the API key it sends (``headers``, from
``prfaas.security.registration.credential``); a refusal (401/403) is logged as a warning, since the instance
stays out of placement until it is fixed.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable

import httpx

from prfaas.messages import InstanceInfo

log = logging.getLogger("prfaas.heartbeat")


class Heartbeat:
    """Sends ``info()`` to ``router_url`` every ``interval_s``; failures are logged and retried, never fatal
    (the router marks us unhealthy if it stops hearing from us, and we re-register when it comes back)."""

    def __init__(self, router_url: str, info: Callable[[], InstanceInfo], interval_s: float,
                 on_refused: Callable[[str], None] | None = None, headers: dict[str, str] | None = None,
                 verify: ssl.SSLContext | bool = True) -> None:
        """``verify``: the role's ``Security.http_verify()`` (its client certificate and CA under TLS)."""
        self.router_url = router_url.rstrip("/")
        self.verify = verify
        self.headers = dict(headers or {})  # the registration credential: never logged
        self.info = info
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self.refused: str | None = None
        self.unauthorized: str | None = None  # the router's last 401/403 reason (logged once per reason)
        self.on_refused = on_refused

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self, deregister: bool = True) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if deregister:
            try:
                async with httpx.AsyncClient(timeout=2.0, verify=self.verify,
                                             headers=self.headers) as client:
                    await client.post(f"{self.router_url}/internal/deregister",
                                      json={"instance_id": self.info().instance_id})
            except httpx.HTTPError:
                pass

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=max(1.0, self.interval_s * 2),
                                     verify=self.verify, headers=self.headers) as client:
            while True:
                try:
                    reply = await client.post(f"{self.router_url}/internal/heartbeat", json=self.info().to_json())
                    if reply.status_code == 409:
                        self.refused = _message(reply) or "refused"
                        if self.on_refused:
                            self.on_refused(self.refused)
                            return
                    elif reply.status_code in (401, 403):
                        self._unauthorized(reply)
                except httpx.HTTPError as exc:
                    log.debug("heartbeat to %s failed: %s", self.router_url, exc)
                await asyncio.sleep(self.interval_s)

    def _unauthorized(self, reply: httpx.Response) -> None:
        """The router refused our registration (wrong certificate or key for this role or id): say so once per
        reason, and keep trying (a fixed key or a restarted router lets us in)."""
        why = _message(reply)
        if why != self.unauthorized:
            self.unauthorized = why
            log.warning("the router at %s refused our registration (HTTP %d): %s", self.router_url,
                        reply.status_code, why)


def _message(reply: httpx.Response) -> str:
    """The message of the router's OpenAI error body, or the start of whatever else it sent (a proxy's page)."""
    try:
        body = reply.json()
    except ValueError:
        return reply.text[:200]
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("message", "")) if isinstance(error, dict) else reply.text[:200]
