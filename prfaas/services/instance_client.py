"""How the router calls its instances: the ``InstanceClient`` interface and its HTTP implementation.

``Dispatcher`` and ``Router`` reach prefill and decode instances only through this interface, so their routing,
fallback and resume rules run unchanged on ``prfaas.services.fake_instances.FakeInstances`` (in memory, scripted)
as on ``HttpInstanceClient`` (the instances' HTTP API).

Failure behaviour, the same for every implementation:
- an instance that cannot be reached, or drops the connection mid-stream, raises ``InstanceUnreachable``
  (``KV_UNAVAILABLE``, naming the instance): the caller decides whether another instance can take over;
- an instance that answers with an error status raises that error (``refusal``: its code where prfaas knows it);
- an error the instance reports inside a stream is yielded as ``Failed`` (data: the caller decides);
- a stream line that breaks the stream's format raises ``KVBadFormat`` (``prfaas.events``).
A stream is an async generator the caller must close (``contextlib.aclosing``): closing it ends the HTTP request.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any, Protocol, TypeVar

import httpx

from prfaas.errors import (
    InstanceUnreachable,
    InvalidRequest,
    KVUnavailable,
    PrfaasError,
    RateLimited,
    error_from_code,
    is_known,
)
from prfaas.events import GenerateEvent, PrefillEvent, generate_event, prefill_event
from prfaas.messages import GenerateRequest, InstanceInfo, Message, PrefillRequest, TokenizeRequest
from prfaas.transfer.abandon import Releaser

E = TypeVar("E")


class InstanceClient(Protocol):
    """The router's calls to instances (see the module docstring for failures). None of them mutates router state."""

    def prefill(self, instance: InstanceInfo, request: PrefillRequest) -> AsyncGenerator[PrefillEvent, None]:
        """``POST /prefill``: ``Accepted``, then ``PrefillDone`` or ``Failed``."""
        ...

    def generate(self, instance: InstanceInfo, request: GenerateRequest) -> AsyncGenerator[GenerateEvent, None]:
        """``POST /generate``: ``Token`` events, then ``Done``; or ``Failed``."""
        ...

    async def tokenize(self, instance: InstanceInfo, request: TokenizeRequest) -> list[int]:
        """The prompt's token ids as ``instance`` tokenizes it."""
        ...

    async def release(self, kv_address: str, kv_id: str) -> None:
        """End the blob ``kv_id`` at the store ``kv_address`` nobody will consume; never raises (its TTL ends it)."""
        ...


class HttpInstanceClient:
    """``InstanceClient`` over the instances' HTTP API and the store's data plane. Owns nothing: ``client`` is
    the router's, closed by the router."""

    def __init__(self, client: httpx.AsyncClient, releaser: Releaser,
                 prefill_headers: dict[str, str] | None = None) -> None:
        """``releaser``: the router's, with its client TLS context for the data plane. ``prefill_headers``: the
        router's client-cluster identity, sent on ``/prefill`` only (``prfaas.tenancy.clusters``)."""
        self.client, self.releaser = client, releaser
        self.prefill_headers = dict(prefill_headers or {})  # holds the cluster's key: never logged

    def prefill(self, instance: InstanceInfo, request: PrefillRequest) -> AsyncGenerator[PrefillEvent, None]:
        return self._stream(instance, "/prefill", request, prefill_event, self.prefill_headers)

    def generate(self, instance: InstanceInfo, request: GenerateRequest) -> AsyncGenerator[GenerateEvent, None]:
        return self._stream(instance, "/generate", request, generate_event)

    async def tokenize(self, instance: InstanceInfo, request: TokenizeRequest) -> list[int]:
        with _reaching(instance):
            reply = await self.client.post(f"{instance.url}/tokenize", json=request.to_json())
        if reply.status_code != 200:
            raise refusal(reply)  # its code and param as the decode instance gave them
        try:
            ids = reply.json().get("token_ids")
        except (ValueError, AttributeError):  # not JSON, or not an object
            ids = None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise KVUnavailable(f"{instance.instance_id} answered /tokenize without a list of token ids")
        return ids

    async def release(self, kv_address: str, kv_id: str) -> None:
        await self.releaser.release(kv_address, kv_id)

    async def _stream(self, instance: InstanceInfo, path: str, request: Message, decode: Callable[[str], E],
                      headers: dict[str, str] | None = None) -> AsyncGenerator[E, None]:
        with _reaching(instance):
            async with self.client.stream("POST", f"{instance.url}{path}", json=request.to_json(),
                                          headers=headers) as reply:
                if reply.status_code != 200:
                    await reply.aread()
                    raise refusal(reply)
                async for line in reply.aiter_lines():
                    if line.strip():
                        yield decode(line)


@contextlib.contextmanager
def _reaching(instance: InstanceInfo) -> Iterator[None]:
    """httpx's failures mapped at the boundary: a transport failure is the instance's (``InstanceUnreachable``),
    any other HTTP failure (an undecodable body) ``KVUnavailable``."""
    try:
        yield
    except httpx.TransportError as exc:
        raise InstanceUnreachable(f"{instance.instance_id} could not be reached: {exc!r}",
                                  instance.instance_id) from exc
    except httpx.HTTPError as exc:
        raise KVUnavailable(f"{instance.instance_id} answered badly: {exc!r}") from exc


def refusal(reply: httpx.Response) -> PrfaasError:
    """What an instance's non-200 answer means. Its error body carries a code of prfaas's tree; without one (a
    proxy's answer, an older peer's null) or with another vocabulary's (``unknown_url``, an unexpected 500's
    ``INTERNAL_ERROR``, vLLM's numeric codes), a 400 or 422 is the request's fault and any other status (a 404
    from a wrong URL) the instance's."""
    body: Any = {}
    if reply.headers.get("content-type", "").startswith("application/json"):
        with contextlib.suppress(ValueError):
            body = reply.json()
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    fallback = InvalidRequest.code if reply.status_code in (400, 422) else KVUnavailable.code
    code = error.get("code")
    exc = error_from_code(code if isinstance(code, str) and is_known(code) else fallback,
                          str(error.get("message") or f"HTTP {reply.status_code}"))
    if isinstance(exc, InvalidRequest) and isinstance(error.get("param"), str):
        exc.param = error["param"]
    if isinstance(exc, RateLimited) and reply.headers.get("retry-after", "").isdigit():
        exc.retry_after_s = int(reply.headers["retry-after"])
    return exc
