"""How the router runs one request across instances.

``Dispatcher.run`` admits the request (rate limit), waits for a decode instance with room (queue depth and free
KV memory, counting what this router already sent it), asks the ``Scheduler`` for the route, and streams events:
``Token`` events (text deltas) and one final ``Done`` (``prfaas.events``). Failures, in order of what can still
be saved:
- a suffix-only blob (docs/prefix-cache.md) that the decode instance refuses before the first token
  (``KV_PREFIX_MISSING``: the prefix left its cache since its heartbeat) → prefilled once more, shipped whole;
- remote prefill fails before the first token → prefill locally on the decode instance (``fallback``);
- the decode instance dies mid-stream → another decode instance re-prefills the prompt plus the tokens already
  streamed and continues, without repeating a token (within ``kv_retry_budget``);
- otherwise the error reaches the client with its code.
A client error an instance answers (``INVALID_REQUEST``, ``PROMPT_REFUSED``: the request itself is at fault) is
none of these: it reaches the client at once as its 400, is not retried elsewhere, and counts as a healthy answer
for the instance's breaker and the link (a bad request must not take an instance or the link out of service).

Instances are reached only through an ``InstanceClient`` (``prfaas.services.instance_client``): HTTP in a
deployment, ``prfaas.services.fake_instances`` in the unit tests of these rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace

from prfaas.config import Config
from prfaas.errors import (
    InstanceUnreachable,
    InvalidRequest,
    KVBadFormat,
    KVPrefixMissing,
    KVTruncated,
    KVUnavailable,
    PoolQuotaExceeded,
    PrfaasError,
    PromptRefused,
)
from prfaas.events import Accepted, Done, Failed, PrefillDone, PrefillEvent, Stages, Token
from prfaas.kv import Fingerprint, new_kv_id
from prfaas.kv.format import PREFIX_VERSION
from prfaas.kv.state import PrefixRef
from prfaas.messages import GenerateRequest, InstanceInfo, PrefillRequest, ResponseMeta, SamplingParams
from prfaas.obs import metrics
from prfaas.scheduler import Decision, Scheduler
from prfaas.scheduler.breaker import OPEN
from prfaas.scheduler.offload import Ticket
from prfaas.scheduler.placement import PromptPrefix
from prfaas.services.instance_client import InstanceClient
from prfaas.services.registry import Registry
from prfaas.tenancy.clusters import DEFAULT_CLUSTER
from prfaas.tenancy.policy import TenantPolicy

QUEUE_POLL_S = 0.05
_CLIENT_FAULTS = (InvalidRequest, PromptRefused)  # the request is at fault, not the instance that said so
Streamed = Token | Done  # what ``Dispatcher.run`` yields


@dataclass
class Job:
    """One request's routing state; ``meta`` becomes the ``prfaas`` field of the response."""

    token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    ignore_eos: bool = False
    arrived: float = field(default_factory=time.perf_counter)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    meta: ResponseMeta = field(default_factory=ResponseMeta)
    first_token_at: float | None = None
    last_token_at: float | None = None
    generated: list[int] = field(default_factory=list)
    pool: str = ""  # the pool key (registry.py) every instance of this request comes from; "" = any
    tenant: TenantPolicy = field(default_factory=TenantPolicy)
    prefill_dc: str = ""  # where its KV was computed (the decode's datacenter on the local route)
    decode_dc: str = ""
    ticket: Ticket | None = None  # its prefill backlog and KV bytes in flight, held until its first token


class Dispatcher:
    def __init__(self, registry: Registry, scheduler: Scheduler, config: Config, instances: InstanceClient):
        self.registry = registry
        self.scheduler = scheduler
        self.config = config
        self.cluster = config.router.cluster or DEFAULT_CLUSTER  # the salt of its prompts' prefixes on the pool
        self.instances = instances
        self._inflight: dict[str, list[int]] = {}  # decode instance → [requests, reserved KV bytes]
        self._ended: dict[str, list[tuple[float, float]]] = {}  # decode instance → (start, end) of ended requests

    async def run(self, job: Job, first_decode: InstanceInfo) -> AsyncGenerator[Streamed]:
        decode, retries = first_decode, 0
        while True:
            held, need = decode.instance_id, decode.kv_bytes(len(job.token_ids) + job.max_tokens)
            self._reserve(held, need, +1)
            started = self.registry.clock()
            try:
                async for event in self._attempt(job, decode):
                    yield event
                self.scheduler.breakers.success(decode.instance_id)
                return
            except _CLIENT_FAULTS:
                self.scheduler.breakers.success(decode.instance_id)  # it answered, correctly
                raise
            except InstanceUnreachable as exc:
                if exc.instance_id != decode.instance_id:  # a prefill's death that fallback did not absorb
                    raise
                self.scheduler.breakers.failure(decode.instance_id)
                if retries >= self.config.transfer.kv_retry_budget:
                    raise KVUnavailable(f"decode instance {decode.instance_id} failed: {exc.message}") from exc
                retries += 1
                if len(job.generated) >= job.max_tokens:  # it died after its last token: nothing left to resume
                    yield Done(finish_reason="length", completion_tokens=len(job.generated))
                    return
                decode = await self.acquire_decode(job, exclude={decode.instance_id})
                job.meta.retries += 1
                job.meta.resumed_on = decode.instance_id
            finally:  # the instance this attempt reserved, even when ``decode`` names its successor now
                self._reserve(held, -need, -1)
                self._ended.setdefault(held, []).append((started, self.registry.clock()))

    async def acquire_decode(self, job: Job, exclude: frozenset[str] | set[str] = frozenset()) -> InstanceInfo:
        """The best decode instance with room; waits up to the queue deadline, then 503 (``degrade_or_queue``)."""
        tokens = len(job.token_ids) + job.max_tokens
        deadline = time.monotonic() + self.config.router.decode_queue_timeout_ms / 1e3
        prompt = PromptPrefix(job.token_ids + job.generated, job.tenant.name,
                              self.cluster)  # what its prefill will compute
        while True:
            instances = [self._view(i) for i in self.registry.healthy("decode", job.pool or None)
                         if i.instance_id not in exclude and job.tenant.allows(i.datacenter)]
            best = self.scheduler.decode_for(instances, max((i.kv_bytes(tokens) for i in instances), default=0),
                                             prompt)
            if best is not None:
                return best
            if not instances:  # nobody to wait for room on (the pool's one decode instance died mid-request)
                besides = f" besides {', '.join(sorted(exclude))}" if exclude else ""
                raise KVUnavailable(f"no healthy decode instance{besides} in this request's pool")
            if all(self.scheduler.breakers.state(i.instance_id) == OPEN for i in instances):  # failing, not full
                raise KVUnavailable("every decode instance of this request's pool is failing (circuit open)")
            if all(i.kv_bytes(tokens) > i.kv_budget_bytes for i in instances):
                raise KVUnavailable(f"the request needs {instances[0].kv_bytes(tokens)} KV bytes, more than any "
                                    f"decode instance holds ({max(i.kv_budget_bytes for i in instances)})")
            if time.monotonic() >= deadline:
                where = f" in tenant {job.tenant.name}'s datacenters" if job.tenant.allowed_datacenters else ""
                raise KVUnavailable(f"no decode instance{where} had room within the queue deadline; retry later")
            await asyncio.sleep(QUEUE_POLL_S)

    def _view(self, info: InstanceInfo) -> InstanceInfo:
        """The heartbeat's figures, corrected by what this router sent and saw end since (heartbeats lag): a
        request of this router's that began before the heartbeat and ended after it was in the heartbeat's queue
        and is no longer (left in, the instance that just served a conversation's turn looked busy to its next)."""
        count, reserved = self._inflight.get(info.instance_id, [0, 0])
        free = min(info.free_kv_bytes, info.kv_budget_bytes - reserved) if info.kv_budget_bytes else info.free_kv_bytes
        return replace(info, queue_depth=max(info.queue_depth - self._ended_since_heartbeat(info.instance_id), count),
                       free_kv_bytes=max(0, free))

    def _ended_since_heartbeat(self, instance_id: str) -> int:
        seen = self.registry.seen_at(instance_id)
        ended = self._ended.get(instance_id)
        if not ended:
            return 0
        if seen is None:
            del self._ended[instance_id]
            return 0
        ended[:] = [(start, end) for start, end in ended if end > seen]  # later heartbeats count the rest
        return sum(1 for start, _ in ended if start < seen)

    def _reserve(self, instance_id: str, kv_bytes: int, count: int) -> None:
        entry = self._inflight.setdefault(instance_id, [0, 0])
        entry[0] += count
        entry[1] += kv_bytes

    async def _attempt(self, job: Job, decode: InstanceInfo) -> AsyncIterator[Streamed]:
        resumed = bool(job.generated)
        codec = job.tenant.kv_codec or self.config.transfer.kv_codec
        prompt = PromptPrefix(job.token_ids, job.tenant.name, self.cluster)
        decision = self.scheduler.route(len(job.token_ids), self.registry.healthy("prefill", job.pool or None),
                                        self.registry.healthy("relay", job.pool or None), job.tenant,
                                        decode.datacenter, decode, codec, prompt) if not resumed else None
        job.decode_dc, job.prefill_dc = decode.datacenter, job.prefill_dc if resumed else decode.datacenter
        if decision is not None:
            job.meta = replace(job.meta, route=decision.route, reason=decision.reason,
                               reason_code=decision.reason_code, decode_instance=decode.instance_id, fallback=False)
            metrics.ROUTES.labels(route=decision.route, reason=decision.reason_code).inc()
            job.ticket = self.scheduler.begin(decision, decode, len(job.token_ids))
            job.meta.kv_codec = decision.codec or None
        try:
            async with contextlib.aclosing(self._routed(job, decode, decision)) as events:
                async for event in events:
                    yield event
        finally:
            if job.ticket is not None:
                job.ticket.close()

    async def _routed(self, job: Job, decode: InstanceInfo, decision: Decision | None) -> AsyncGenerator[Streamed]:
        if decision is not None and decision.route == "remote":
            try:
                async for event in self._remote_or_whole(job, decode, decision):
                    yield event
                return
            except PrfaasError as exc:
                if job.first_token_at is not None or isinstance(exc, _CLIENT_FAULTS) or _decode_failed(exc, decode):
                    raise
                self._fell_back(job, exc)
        first = not job.generated
        async for event in self._decode(job, decode, self._local_request(job)):
            if first and isinstance(event, Token):  # decode's first-token stages time its local prefill
                first = False
                self._local_facts(job, decode)
            yield event

    def _local_facts(self, job: Job, decode: InstanceInfo) -> None:
        if job.meta.stages is not None and job.meta.stages.prefill_ms:
            self.scheduler.local_prefill_done(decode, self._computed(job, decode),
                                              job.meta.stages.prefill_ms / 1e3)

    def _computed(self, job: Job, info: InstanceInfo) -> int:
        """The prompt tokens ``info`` computed, as its summary said when it was chosen: a prefix it reused is not
        prefill speed (counted, it made an instance that served a cached turn look faster than its neighbours)."""
        return max(1, len(job.token_ids) - PromptPrefix(job.token_ids, job.tenant.name, self.cluster).held(info))

    def _fell_back(self, job: Job, exc: PrfaasError) -> None:
        if not self.config.router.fallback_local_prefill:
            raise exc
        metrics.FALLBACKS.labels(reason=exc.code).inc()
        job.prefill_dc = job.decode_dc
        job.meta = replace(job.meta, route="local", fallback=True, retries=job.meta.retries + 1,
                           reason=f"remote prefill failed ({exc.code}: {exc.message}); prefilled locally",
                           reason_code="pool_quota" if isinstance(exc, PoolQuotaExceeded) else job.meta.reason_code)

    def _local_request(self, job: Job) -> GenerateRequest:
        """Local prefill; after a decode death, of the prompt plus what was already streamed."""
        return GenerateRequest(request_id=job.request_id, token_ids=job.token_ids + job.generated,
                               max_tokens=job.max_tokens - len(job.generated), sampling=job.sampling,
                               stop=job.stop, ignore_eos=job.ignore_eos, step_offset=len(job.generated),
                               tenant=job.tenant.name)

    async def _remote_or_whole(self, job: Job, decode: InstanceInfo, decision: Decision) -> AsyncIterator[Streamed]:
        """The remote route, with a suffix-only blob where ``decode`` holds a prefix of the prompt; one that decode
        refuses before its first token (the prefix left its cache since its heartbeat) is prefilled once more and
        shipped whole."""
        extends = self._extends(job, decode)
        try:
            async for event in self._remote(job, decode, decision, extends):
                yield event
        except KVPrefixMissing:
            if extends is None or job.first_token_at is not None:
                raise
            metrics.PREFIX_SUFFIX_BLOBS.labels(outcome="refused").inc()
            job.meta.retries += 1
            async for event in self._remote(job, decode, decision, None):
                yield event

    def _extends(self, job: Job, decode: InstanceInfo) -> PrefixRef | None:
        """The prefix a suffix-only blob may leave out: what ``decode``'s summary says it holds, when every decode
        instance of the pool reads blob format ``PREFIX_VERSION``."""
        if self._reader_version(job) < PREFIX_VERSION:
            return None
        return PromptPrefix(job.token_ids, job.tenant.name, self.cluster).extends(decode)

    async def _remote(self, job: Job, decode: InstanceInfo, decision: Decision,
                      extends: PrefixRef | None) -> AsyncIterator[Streamed]:
        prefill, relay = decision.prefill, decision.relay
        assert prefill is not None
        if extends is not None:
            metrics.PREFIX_SUFFIX_BLOBS.labels(outcome="sent").inc()
        job.meta.kv_prefix_tokens = extends.tokens if extends else None
        kv_id = new_kv_id(Fingerprint.from_wire(decode.fingerprint).short_hash())
        job.meta.kv_id, job.meta.prefill_instance = kv_id, prefill.instance_id
        job.prefill_dc = prefill.datacenter
        body = PrefillRequest(request_id=job.request_id, kv_id=kv_id, token_ids=job.token_ids,
                              sampling=job.sampling, push_to=relay.kv_address if relay else "",
                              format_version=self._reader_version(job), tenant=job.tenant.name,
                              kv_codec=decision.codec or job.tenant.kv_codec, kv_ttl_seconds=job.tenant.kv_ttl_seconds,
                              prefix_hash=extends.chain_hash if extends else "",
                              prefix_tokens=extends.tokens if extends else 0)
        pull = GenerateRequest(request_id=job.request_id, token_ids=job.token_ids, max_tokens=job.max_tokens,
                               sampling=job.sampling, stop=job.stop, ignore_eos=job.ignore_eos, kv_id=kv_id,
                               kv_address=relay.kv_address if relay else prefill.kv_address,
                               tenant=job.tenant.name)  # decode stores the restored prompt under its tenant
        failed = False
        try:
            async for event in self._remote_stream(job, decode, prefill, body, pull):
                yield event
        except PrfaasError:
            failed = True
            raise
        finally:
            # nobody will consume the blob: decode never restored it (it failed, the router fell back, the client
            # left), or decode failed after a token (a vLLM decode streams prefill's first token before its pull)
            if job.first_token_at is None or failed:
                await self.instances.release(pull.kv_address, kv_id)

    async def _remote_stream(self, job: Job, decode: InstanceInfo, prefill: InstanceInfo, body: PrefillRequest,
                             pull: GenerateRequest) -> AsyncIterator[Streamed]:
        try:
            async with contextlib.aclosing(self.instances.prefill(prefill, body)) as events:
                accepted = await _next_prefill(events)
                if not isinstance(accepted, Accepted):
                    raise _unexpected(accepted, "accepted")
                pull = _with_first_token(pull, accepted)
                done: asyncio.Task[PrefillEvent] = asyncio.ensure_future(_next_prefill(events))
                proven = False
                try:
                    async for event in self._decode(job, decode, pull):
                        if not proven and job.first_token_at is not None:  # its KV reached decode: healthy
                            proven = True
                            self.scheduler.breakers.success(prefill.instance_id)
                        if isinstance(event, Done):
                            self._prefill_facts(job, prefill, await _outcome(done))
                            self._recomputed(job, event)
                        yield event
                finally:
                    done.cancel()
                    await asyncio.gather(done, return_exceptions=True)
        except (*_CLIENT_FAULTS, PoolQuotaExceeded, KVPrefixMissing) as exc:  # it answered, correctly (this
            # cluster is over quota; decode no longer holds the prefix the blob extends)
            if job.first_token_at is None:
                self.scheduler.breakers.success(prefill.instance_id)
            if isinstance(exc, PoolQuotaExceeded):  # not asked again until its Retry-After (scheduler.quota)
                self.scheduler.quota.hold(prefill.instance_id, self.scheduler.cluster, exc.retry_after_s)
            raise
        except PrfaasError:
            self.scheduler.transfer_done(job.ticket, ok=False)
            if job.first_token_at is None:
                self.scheduler.breakers.failure(prefill.instance_id)
            raise
        self.scheduler.breakers.success(prefill.instance_id)

    @staticmethod
    def _recomputed(job: Job, done: Done) -> None:
        """Decode could not use the KV it was sent and computed the prompt itself: the prompt was prefilled
        locally after all, and the response and the route metrics say so."""
        if not done.recomputed:
            return
        metrics.FALLBACKS.labels(reason="recomputed").inc()
        job.prefill_dc = job.decode_dc
        job.meta = replace(job.meta, route="local", fallback=True,
                           reason=f"decode could not use the prompt's KV; it recomputed {done.recomputed} tokens")

    def _reader_version(self, job: Job) -> int:
        """The oldest blob format the pool's decode instances are at: prefill writes what all of them read."""
        versions = [int(i.fingerprint.get("format_version", 0)) for i in self.registry.healthy("decode", job.pool
                    or None) if i.fingerprint]
        return min(versions, default=0)

    def _prefill_facts(self, job: Job, prefill: InstanceInfo, done: PrefillEvent) -> None:
        if not isinstance(done, PrefillDone):  # the KV reached decode before prefill failed: nothing to learn
            return
        job.meta.kv_bytes = done.kv_bytes
        job.meta.add_stages(Stages(queue_ms=done.queue_ms, prefill_ms=done.prefill_ms))
        self.scheduler.prefill_done(prefill.instance_id, self._computed(job, prefill), done.prefill_ms / 1e3)
        transfer_ms = job.meta.stages.transfer_ms if job.meta.stages else None
        exposed = (transfer_ms or 0.0) - done.prefill_ms - done.queue_ms
        restore_ms = job.meta.stages.restore_ms if job.meta.stages else None
        self.scheduler.transfer_done(job.ticket, ok=True, kv_bytes=done.kv_bytes, exposed_s=max(0.0, exposed) / 1e3,
                                     restore_s=None if restore_ms is None else restore_ms / 1e3,
                                     prefill_s=done.prefill_ms / 1e3)
        metrics.TRANSFER_EXPOSED.observe(max(0.0, exposed) / 1e3)

    async def _decode(self, job: Job, decode: InstanceInfo, body: GenerateRequest) -> AsyncIterator[Streamed]:
        streamed = False
        async with contextlib.aclosing(self.instances.generate(decode, body)) as events:
            async for event in events:
                if isinstance(event, Failed):
                    raise _decode_error(event, decode, streamed)
                if isinstance(event, Token):
                    streamed = True
                    self._token(job, event)
                yield event
                if isinstance(event, Done):
                    return
        raise KVTruncated(f"decode instance {decode.instance_id} ended its stream without a 'done' event")

    @staticmethod
    def _token(job: Job, event: Token) -> None:
        now = time.perf_counter()
        if job.first_token_at is None:
            job.first_token_at = now
            if job.ticket is not None:  # its prefill is done and its KV delivered
                job.ticket.close()
            if event.stages is not None:
                job.meta.add_stages(event.stages)
            job.meta.ttft_ms = round((now - job.arrived) * 1e3, 2)
            if event.stages is not None and event.stages.transfer_ms is not None:
                job.meta.transfer_ms = round(event.stages.transfer_ms, 2)
        elif job.last_token_at is not None:
            metrics.ITL.observe(now - job.last_token_at)
        job.last_token_at = now
        job.generated.append(event.token)


def _with_first_token(pull: GenerateRequest, accepted: Accepted) -> GenerateRequest:
    """Decode's request with the first token prefill already sampled (a vLLM prefill says it at ``accepted``):
    decode streams it at once instead of computing it again after the pull."""
    if accepted.first_token is None or accepted.kv_tokens is None:
        return pull
    return replace(pull, first_token=accepted.first_token, first_text=accepted.first_text or "",
                   kv_tokens=accepted.kv_tokens)


def _decode_error(event: Failed, decode: InstanceInfo, streamed: bool) -> PrfaasError:
    """A decode instance's ``error``. Before its stream's first token it is what the instance said (the caller may
    still prefill locally on that instance). After a token, the instance failed mid-stream (a vLLM decode whose
    engine died after prefill's first token went out): ``InstanceUnreachable``, so that another instance resumes
    from the tokens already streamed, as after a cut connection; a client fault stays one."""
    error = event.error()
    if not streamed or isinstance(error, _CLIENT_FAULTS):
        return error
    return InstanceUnreachable(f"decode instance {decode.instance_id} failed mid-stream ({error.code}: "
                               f"{error.message})", decode.instance_id)


def _decode_failed(exc: PrfaasError, decode: InstanceInfo) -> bool:
    return isinstance(exc, InstanceUnreachable) and exc.instance_id == decode.instance_id


async def _next_prefill(events: AsyncIterator[PrefillEvent]) -> PrefillEvent:
    """The prefill stream's next event; a stream that ends before its ``done`` is ``KVTruncated``."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        raise KVTruncated("the prefill stream ended before its 'done' event") from None


async def _outcome(done: asyncio.Task[PrefillEvent]) -> PrefillEvent:
    """The prefill stream's last event; its failure as data, since decode already holds the KV and finished."""
    try:
        return await done
    except PrfaasError as exc:
        return Failed.of(exc)


def _unexpected(event: PrefillEvent, wanted: str) -> PrfaasError:
    """A ``Failed`` event's own error; any other event out of place breaks the stream's format."""
    if isinstance(event, Failed):
        return event.error()
    return KVBadFormat(f"the prefill stream sent {event.tag!r} where {wanted!r} belongs")
