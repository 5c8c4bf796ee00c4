"""How the router runs one request across instances: remote prefill (prefill → store → decode) or local
prefill on the decode instance, with fallback to local when the remote path fails before the first token.

``Dispatcher.run`` yields ``token`` events (text deltas) and ends with one ``done`` event that carries the
finish reason, the usage and the ``prfaas`` response extension of CONTRACTS.md.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from prfaas.config import Config
from prfaas.errors import KVUnavailable, PrfaasError, error_from_code
from prfaas.kv import Fingerprint, new_kv_id
from prfaas.messages import GenerateRequest, InstanceInfo, PrefillRequest, SamplingParams
from prfaas.obs import metrics
from prfaas.services.registry import Registry


@dataclass
class Job:
    """One request's routing state; ``extension`` becomes the ``prfaas`` field of the response."""

    token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    arrived: float = field(default_factory=time.perf_counter)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    extension: dict[str, Any] = field(default_factory=dict)
    first_token_at: float | None = None


class Dispatcher:
    def __init__(self, registry: Registry, config: Config, mode: str, client: httpx.AsyncClient) -> None:
        self.registry = registry
        self.config = config
        self.mode = mode
        self.client = client

    def route(self, job: Job) -> tuple[str, str]:
        """(route, reason): remote only for prompts over the threshold, with a prefill (and relay) up."""
        n, threshold = len(job.token_ids), self.config.offload_threshold_tokens
        if n <= threshold:
            return "local", f"prompt of {n} tokens is within the offload threshold of {threshold}"
        if not self.registry.healthy("prefill"):
            return "local", "no healthy prefill instance"
        if self.mode == "relay" and not self.registry.healthy("relay"):
            return "local", "no healthy relay"
        return "remote", f"prompt of {n} tokens is over the offload threshold of {threshold}"

    async def run(self, job: Job, decode: InstanceInfo) -> AsyncIterator[dict[str, Any]]:
        route, reason = self.route(job)
        job.extension.update(route=route, reason=reason, decode_instance=decode.instance_id, retries=0,
                             fallback=False)
        self.registry.bump(decode.instance_id)
        if route == "remote":
            try:
                async for event in self._remote(job, decode):
                    yield event
                return
            except (PrfaasError, httpx.HTTPError) as exc:
                if job.first_token_at is not None or not self.config.fallback_local_prefill:
                    raise
                code = exc.code if isinstance(exc, PrfaasError) else KVUnavailable.code
                metrics.FALLBACKS.labels(reason=code).inc()
                job.extension.update(route="local", fallback=True, retries=1,
                                     reason=f"remote prefill failed ({code}: {exc}); prefilled locally")
        async for event in self._decode(job, decode, GenerateRequest(
                request_id=job.request_id, token_ids=job.token_ids, max_tokens=job.max_tokens,
                sampling=job.sampling.to_json(), stop=job.stop)):
            yield event

    async def _remote(self, job: Job, decode: InstanceInfo) -> AsyncIterator[dict[str, Any]]:
        prefill = self.registry.pick("prefill")
        relay = self.registry.pick("relay") if self.mode == "relay" else None
        if prefill is None or (self.mode == "relay" and relay is None):
            raise KVUnavailable("no healthy prefill instance or relay")
        self.registry.bump(prefill.instance_id)
        kv_id = new_kv_id(Fingerprint.from_wire(decode.fingerprint).short_hash())
        kv_address = relay.kv_address if relay else prefill.kv_address
        job.extension.update(kv_id=kv_id, prefill_instance=prefill.instance_id)
        body = PrefillRequest(request_id=job.request_id, kv_id=kv_id, token_ids=job.token_ids,
                              sampling=job.sampling.to_json(), push_to=relay.kv_address if relay else "")
        async with self.client.stream("POST", f"{prefill.url}/prefill", json=body.to_json()) as reply:
            lines = _events(reply)
            accepted = await anext(lines)
            if accepted.get("event") != "accepted":
                raise _error(accepted)
            prefill_done: asyncio.Task[dict[str, Any]] = asyncio.ensure_future(anext(lines))
            try:
                async for event in self._decode(job, decode, GenerateRequest(
                        request_id=job.request_id, token_ids=job.token_ids, max_tokens=job.max_tokens,
                        sampling=job.sampling.to_json(), stop=job.stop, kv_id=kv_id, kv_address=kv_address)):
                    if event["event"] == "done":
                        self._prefill_facts(job, await prefill_done)
                    yield event
            finally:
                prefill_done.cancel()
                await asyncio.gather(prefill_done, return_exceptions=True)

    @staticmethod
    def _prefill_facts(job: Job, done: dict[str, Any]) -> None:
        if done.get("event") != "done":
            return
        job.extension["kv_bytes"] = done["kv_bytes"]
        stages = job.extension.setdefault("stages", {})
        stages.update(queue_ms=round(done["queue_ms"], 2), prefill_ms=round(done["prefill_ms"], 2))

    async def _decode(self, job: Job, decode: InstanceInfo, body: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        async with self.client.stream("POST", f"{decode.url}/generate", json=body.to_json()) as reply:
            async for event in _events(reply):
                kind = event.get("event")
                if kind == "error":
                    raise _error(event)
                if kind == "token" and job.first_token_at is None:
                    self._first_token(job, event)
                yield event

    @staticmethod
    def _first_token(job: Job, event: dict[str, Any]) -> None:
        job.first_token_at = time.perf_counter()
        stages = {k: round(v, 2) for k, v in event.get("stages", {}).items()}
        job.extension.setdefault("stages", {}).update(stages)
        job.extension["ttft_ms"] = round((job.first_token_at - job.arrived) * 1e3, 2)
        if "transfer_ms" in stages:
            job.extension["transfer_ms"] = stages["transfer_ms"]


def new_seed() -> int:
    return secrets.randbits(31)


async def _events(reply: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    if reply.status_code != 200:
        await reply.aread()
        raise _error(reply.json().get("error", {}) if reply.headers.get("content-type", "").startswith(
            "application/json") else {"code": KVUnavailable.code, "message": f"HTTP {reply.status_code}"})
    async for line in reply.aiter_lines():
        if line.strip():
            yield json.loads(line)


def _error(event: dict[str, Any]) -> PrfaasError:
    return error_from_code(str(event.get("code") or KVUnavailable.code), str(event.get("message", "")))
