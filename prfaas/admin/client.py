"""The router as ``prfaas admin`` sees it: JSON over HTTP, with the API key when one is given.

The key (``--api-key`` or ``$PRFAAS_API_KEY``) travels only in the ``Authorization`` header; it is never printed,
logged or put in an error message (``repr`` hides it). Failures become ``AdminError`` with the router's own
message, so every command prints one line and exits 2.
"""

from __future__ import annotations

from typing import Any

import httpx

from prfaas.tls import handshake_hint, https_verify

API_KEY_ENV = "PRFAAS_API_KEY"


class AdminError(Exception):
    """The router could not be reached or refused the call; ``str`` is safe to print."""


class RouterClient:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 10.0, ca: str | None = None) -> None:
        """``ca``: the CA file an ``https://`` router's certificate is checked against (else the system's store)."""
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self._verify = https_verify(ca)

    def __repr__(self) -> str:
        return f"RouterClient({self.url!r}, api_key={'set' if self._headers else 'none'})"

    def get(self, path: str) -> Any:
        return self._json(self._call("GET", path, None), path)

    def post(self, path: str, body: Any = None) -> Any:
        return self._json(self._call("POST", path, body), path)

    def text(self, path: str) -> str:
        """A plain-text page (``/metrics``)."""
        reply = self._call("GET", path, None)
        self._check(reply, path)
        return reply.text

    def _call(self, method: str, path: str, body: Any) -> httpx.Response:
        try:
            return httpx.request(method, f"{self.url}{path}", json=body, headers=self._headers,
                                 timeout=self.timeout_s, verify=self._verify)
        except httpx.HTTPError as exc:
            said = f"{type(exc).__name__}{handshake_hint(exc)}"
            raise AdminError(f"cannot reach the router at {self.url}: {said}") from None

    def _json(self, reply: httpx.Response, path: str) -> Any:
        self._check(reply, path)
        return reply.json()

    def _check(self, reply: httpx.Response, path: str) -> None:
        if reply.status_code < 400:
            return
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text[:200]
        hint = f" (give the key with --api-key or ${API_KEY_ENV})" if reply.status_code == 401 else ""
        raise AdminError(f"{path}: HTTP {reply.status_code}: {message}{hint}")

