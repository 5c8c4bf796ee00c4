"""How the router runs one request across instances.

``Dispatcher.run`` admits the request (rate limit), waits for a decode instance with room (queue depth and free
KV memory, counting what this router already sent it), asks the ``Scheduler`` for the route, and streams events:
``token`` events (text deltas) and one final ``done`` event. Failures, in order of what can still be saved:
- remote prefill fails before the first token → prefill locally on the decode instance (``fallback``);
- the decode instance dies mid-stream → another decode instance re-prefills the prompt plus the tokens already
  streamed and continues, without repeating a token (within ``kv_retry_budget``);
- otherwise the error reaches the client with its code.
A client error an instance answers (``INVALID_REQUEST``, ``PROMPT_REFUSED``: the request itself is at fault) is
none of these: it reaches the client at once as its 400, is not retried elsewhere, and counts as a healthy answer
for the instance's breaker and the link (a bad request must not take an instance or the link out of service).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from prfaas.config import Config
from prfaas.errors import InvalidRequest, KVUnavailable, PrfaasError, PromptRefused, error_from_code, is_known
from prfaas.kv import Fingerprint, new_kv_id
from prfaas.messages import GenerateRequest, InstanceInfo, PrefillRequest, SamplingParams
from prfaas.obs import metrics
from prfaas.scheduler import Decision, Scheduler
from prfaas.security import runtime as tls_runtime
from prfaas.services.registry import Registry
from prfaas.store.abandon import release_abandoned
from prfaas.tenancy.policy import TenantPolicy

QUEUE_POLL_S = 0.05
_DEAD = (httpx.TransportError,)
_CLIENT_FAULTS = (InvalidRequest, PromptRefused)  # the request is at fault, not the instance that said so


@dataclass
class Job:
    """One request's routing state; ``extension`` becomes the ``prfaas`` field of the response."""

    token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    ignore_eos: bool = False
    arrived: float = field(default_factory=time.perf_counter)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    extension: dict[str, Any] = field(default_factory=dict)
    first_token_at: float | None = None
    last_token_at: float | None = None
    generated: list[int] = field(default_factory=list)
    pool: str = ""  # the pool key (registry.py) every instance of this request comes from; "" = any
    tenant: TenantPolicy = field(default_factory=TenantPolicy)
    prefill_dc: str = ""  # where its KV was computed (the decode's datacenter on the local route)
    decode_dc: str = ""


class Dispatcher:
    def __init__(self, registry: Registry, scheduler: Scheduler, config: Config, client: httpx.AsyncClient):
        self.registry = registry
        self.scheduler = scheduler
        self.config = config
        self.client = client
        self._inflight: dict[str, list[int]] = {}  # decode instance → [requests, reserved KV bytes]

    async def run(self, job: Job, first_decode: InstanceInfo) -> AsyncIterator[dict[str, Any]]:
        decode, retries = first_decode, 0
        while True:
            need = decode.kv_bytes(len(job.token_ids) + job.max_tokens)
            self._reserve(decode.instance_id, need, +1)
            try:
                async for event in self._attempt(job, decode):
                    yield event
                self.scheduler.breakers.success(decode.instance_id)
                return
            except _CLIENT_FAULTS:
                self.scheduler.breakers.success(decode.instance_id)  # it answered, correctly
                raise
            except _DEAD as exc:
                self.scheduler.breakers.failure(decode.instance_id)
                if retries >= self.config.kv_retry_budget:
                    raise KVUnavailable(f"decode instance {decode.instance_id} failed: {exc!r}") from exc
                retries += 1
                if len(job.generated) >= job.max_tokens:  # it died after its last token: nothing left to resume
                    yield {"event": "done", "finish_reason": "length", "completion_tokens": len(job.generated),
                           "text": ""}
                    return
                decode = await self.acquire_decode(job, exclude={decode.instance_id})
                job.extension.update(retries=job.extension.get("retries", 0) + 1, resumed_on=decode.instance_id)
            finally:
                self._reserve(decode.instance_id, -need, -1)

    async def acquire_decode(self, job: Job, exclude: frozenset[str] | set[str] = frozenset()) -> InstanceInfo:
        """The best decode instance with room; waits up to the queue deadline, then 503 (``degrade_or_queue``)."""
        tokens = len(job.token_ids) + job.max_tokens
        deadline = time.monotonic() + self.config.decode_queue_timeout_ms / 1e3
        while True:
            instances = [self._view(i) for i in self.registry.healthy("decode", job.pool or None)
                         if i.instance_id not in exclude and job.tenant.allows(i.datacenter)]
            best = self.scheduler.decode_for(instances, max((i.kv_bytes(tokens) for i in instances), default=0))
            if best is not None:
                return best
            if instances and all(i.kv_bytes(tokens) > i.kv_budget_bytes for i in instances):
                raise KVUnavailable(f"the request needs {instances[0].kv_bytes(tokens)} KV bytes, more than any "
                                    f"decode instance holds ({max(i.kv_budget_bytes for i in instances)})")
            if time.monotonic() >= deadline:
                where = f" in tenant {job.tenant.name}'s datacenters" if job.tenant.allowed_datacenters else ""
                raise KVUnavailable(f"no decode instance{where} had room within the queue deadline; retry later")
            await asyncio.sleep(QUEUE_POLL_S)

    def _view(self, info: InstanceInfo) -> InstanceInfo:
        """The heartbeat's figures, corrected by what this router sent since (heartbeats lag)."""
        count, reserved = self._inflight.get(info.instance_id, [0, 0])
        free = min(info.free_kv_bytes, info.kv_budget_bytes - reserved) if info.kv_budget_bytes else info.free_kv_bytes
        return InstanceInfo.from_json({**info.to_json(), "queue_depth": max(info.queue_depth, count),
                                       "free_kv_bytes": max(0, free)})

    def _reserve(self, instance_id: str, kv_bytes: int, count: int) -> None:
        entry = self._inflight.setdefault(instance_id, [0, 0])
        entry[0] += count
        entry[1] += kv_bytes

    async def _attempt(self, job: Job, decode: InstanceInfo) -> AsyncIterator[dict[str, Any]]:
        resumed = bool(job.generated)
        decision = self.scheduler.route(len(job.token_ids), self.registry.healthy("prefill", job.pool or None),
                                        self.registry.healthy("relay", job.pool or None), job.tenant,
                                        decode.datacenter) if not resumed else None
        job.decode_dc, job.prefill_dc = decode.datacenter, job.prefill_dc if resumed else decode.datacenter
        if decision is not None:
            job.extension.update(route=decision.route, reason=decision.reason, reason_code=decision.reason_code,
                                 decode_instance=decode.instance_id,
                                 retries=job.extension.get("retries", 0), fallback=False)
            metrics.ROUTES.labels(route=decision.route, reason=decision.reason_code).inc()
        if decision is not None and decision.route == "remote":
            try:
                async for event in self._remote(job, decode, decision):
                    yield event
                return
            except (PrfaasError, httpx.HTTPError) as exc:
                if job.first_token_at is not None or isinstance(exc, _CLIENT_FAULTS) or (
                        isinstance(exc, _DEAD) and _decode_failed(exc, decode)):
                    raise
                self._fell_back(job, exc)
        async for event in self._decode(job, decode, self._local_request(job)):
            yield event

    def _fell_back(self, job: Job, exc: Exception) -> None:
        if not self.config.fallback_local_prefill:
            raise exc
        code = exc.code if isinstance(exc, PrfaasError) else KVUnavailable.code
        metrics.FALLBACKS.labels(reason=code).inc()
        job.prefill_dc = job.decode_dc
        job.extension.update(route="local", fallback=True, retries=job.extension.get("retries", 0) + 1,
                             reason=f"remote prefill failed ({code}: {exc}); prefilled locally")

    def _local_request(self, job: Job) -> GenerateRequest:
        """Local prefill; after a decode death, of the prompt plus what was already streamed."""
        return GenerateRequest(request_id=job.request_id, token_ids=job.token_ids + job.generated,
                               max_tokens=job.max_tokens - len(job.generated), sampling=job.sampling.to_json(),
                               stop=job.stop, ignore_eos=job.ignore_eos, step_offset=len(job.generated))

    async def _remote(self, job: Job, decode: InstanceInfo, decision: Decision) -> AsyncIterator[dict[str, Any]]:
        prefill, relay = decision.prefill, decision.relay
        assert prefill is not None
        kv_id = new_kv_id(Fingerprint.from_wire(decode.fingerprint).short_hash())
        job.extension.update(kv_id=kv_id, prefill_instance=prefill.instance_id)
        job.prefill_dc = prefill.datacenter
        body = PrefillRequest(request_id=job.request_id, kv_id=kv_id, token_ids=job.token_ids,
                              sampling=job.sampling.to_json(), push_to=relay.kv_address if relay else "",
                              format_version=self._reader_version(job), tenant=job.tenant.name,
                              kv_codec=job.tenant.kv_codec, kv_ttl_seconds=job.tenant.kv_ttl_seconds)
        pull = GenerateRequest(request_id=job.request_id, token_ids=job.token_ids, max_tokens=job.max_tokens,
                               sampling=job.sampling.to_json(), stop=job.stop, ignore_eos=job.ignore_eos, kv_id=kv_id,
                               kv_address=relay.kv_address if relay else prefill.kv_address)
        try:
            async for event in self._remote_stream(job, decode, prefill, body, pull):
                yield event
        finally:
            if job.first_token_at is None:  # decode never restored it (failed, fell back, client left)
                await release_abandoned(pull.kv_address, kv_id, ssl=tls_runtime.client_ssl())

    async def _remote_stream(self, job: Job, decode: InstanceInfo, prefill: InstanceInfo, body: PrefillRequest,
                             pull: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        try:
            async with self.client.stream("POST", f"{prefill.url}/prefill", json=body.to_json()) as reply:
                lines = _events(reply)
                accepted = await anext(lines)
                if accepted.get("event") != "accepted":
                    raise _error(accepted)
                done: asyncio.Task[dict[str, Any]] = asyncio.ensure_future(anext(lines))
                proven = False
                try:
                    async for event in self._decode(job, decode, pull):
                        if not proven and job.first_token_at is not None:  # its KV reached decode: healthy
                            proven = True
                            self.scheduler.breakers.success(prefill.instance_id)
                        if event["event"] == "done":
                            self._prefill_facts(job, prefill, await done)
                        yield event
                finally:
                    done.cancel()
                    await asyncio.gather(done, return_exceptions=True)
        except _CLIENT_FAULTS:
            if job.first_token_at is None:
                self.scheduler.breakers.success(prefill.instance_id)
            raise
        except (PrfaasError, httpx.HTTPError):
            self.scheduler.link.record(ok=False)
            if job.first_token_at is None:
                self.scheduler.breakers.failure(prefill.instance_id)
            raise
        self.scheduler.breakers.success(prefill.instance_id)

    def _reader_version(self, job: Job) -> int:
        """The oldest blob format the pool's decode instances are at: prefill writes what all of them read."""
        versions = [int(i.fingerprint.get("format_version", 0)) for i in self.registry.healthy("decode", job.pool
                    or None) if i.fingerprint]
        return min(versions, default=0)

    def _prefill_facts(self, job: Job, prefill: InstanceInfo, done: dict[str, Any]) -> None:
        if done.get("event") != "done":
            return
        job.extension["kv_bytes"] = done["kv_bytes"]
        stages = job.extension.setdefault("stages", {})
        stages.update(queue_ms=round(done["queue_ms"], 2), prefill_ms=round(done["prefill_ms"], 2))
        self.scheduler.prefill_done(prefill.instance_id, len(job.token_ids), done["prefill_ms"] / 1e3)
        exposed = stages.get("transfer_ms", 0.0) - done["prefill_ms"] - done["queue_ms"]
        self.scheduler.link.record(ok=True, exposed_ms=exposed)
        metrics.TRANSFER_EXPOSED.observe(max(0.0, exposed) / 1e3)

    async def _decode(self, job: Job, decode: InstanceInfo, body: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        async with self.client.stream("POST", f"{decode.url}/generate", json=body.to_json()) as reply:
            async for event in _events(reply):
                kind = event.get("event")
                if kind == "error":
                    raise _error(event)
                if kind == "token":
                    self._token(job, event)
                yield event

    @staticmethod
    def _token(job: Job, event: dict[str, Any]) -> None:
        now = time.perf_counter()
        if job.first_token_at is None:
            job.first_token_at = now
            stages = {k: round(v, 2) for k, v in event.get("stages", {}).items()}
            job.extension.setdefault("stages", {}).update(stages)
            job.extension["ttft_ms"] = round((now - job.arrived) * 1e3, 2)
            if "transfer_ms" in stages:
                job.extension["transfer_ms"] = stages["transfer_ms"]
        elif job.last_token_at is not None:
            metrics.ITL.observe(now - job.last_token_at)
        job.last_token_at = now
        job.generated.append(int(event["token"]))


def _decode_failed(exc: Exception, decode: InstanceInfo) -> bool:
    request = getattr(exc, "request", None)
    return request is not None and str(request.url).startswith(decode.url)


async def _events(reply: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    if reply.status_code != 200:
        await reply.aread()
        raise refusal(reply)
    async for line in reply.aiter_lines():
        if line.strip():
            yield json.loads(line)


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
    exc = _error({"code": code if isinstance(code, str) and is_known(code) else fallback,
                  "message": error.get("message") or f"HTTP {reply.status_code}"})
    if isinstance(exc, InvalidRequest) and isinstance(error.get("param"), str):
        exc.param = error["param"]
    return exc


def _error(event: dict[str, Any]) -> PrfaasError:
    return error_from_code(str(event.get("code") or KVUnavailable.code), str(event.get("message", "")))
