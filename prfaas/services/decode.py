"""The decode role (datacenter B): pulls KV by ``kv_id``, verifies and restores it, acknowledges release, then
decodes in a continuous batch with every other running sequence. Short prompts are prefilled here too (the local
route), in chunks interleaved with decode steps.

Events (NDJSON to the router): ``token`` {text, token}, the first one with ``stages``; ``done`` {finish_reason,
completion_tokens}; or ``error`` {code, message}.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from prfaas.config import Config
from prfaas.errors import InvalidRequest, KVNotFound, KVPrefixMissing, PrfaasError
from prfaas.events import Done, Failed, GenerateEvent, Stages, Token
from prfaas.kv import BlobReader, KVState
from prfaas.kv.frames import FRAME_POOL_BYTES, FramePool
from prfaas.messages import GenerateRequest, SamplingParams, TcpPeer
from prfaas.obs import metrics
from prfaas.security.runtime import PLAINTEXT, Security
from prfaas.services.decode_scheduler import DecodeScheduler, Prepared, Sequence
from prfaas.services.textstream import TextStream
from prfaas.services.tokenizing import Tokenizing
from prfaas.transfer import TransferContext, pull, release

if TYPE_CHECKING:  # the protocol's name only: importing prfaas.engine at run time loads torch
    from prfaas.engine.prefix_prefill import PrefixPrefill
    from prfaas.engine.protocol import Engine
from prfaas.transfer.abandon import release_abandoned

CREATION_GRACE_S = 2.0  # relay mode: the header may still be on its way to the relay


class DecodeService:
    """The decode role's work: tokenising, pulling and restoring KV, and streaming tokens from the scheduler."""

    def __init__(self, engine: Engine, config: Config, security: Security = PLAINTEXT,
                 prefix: PrefixPrefill | None = None) -> None:
        self.engine = engine
        self.config = config
        self.prefix = prefix  # the engine's prefix cache for local prefills (docs/prefix-cache.md); None: off
        self.scheduler = DecodeScheduler(engine, config.decode.decode_max_batch, prefix.sweep if prefix else None)
        self.reserved_kv_bytes = 0
        self.fixed_bytes, self.bytes_per_token = engine.kv_footprint
        self.keeps_kv = engine.keeps_kv  # False: pulled KV is verified, then dropped
        self.frames = FramePool(FRAME_POOL_BYTES)  # chunks pulled without an arena (keeps_kv False), reused
        self.tokenizing = Tokenizing(engine.tokenizer, engine.max_seq_len)
        # what every pull of this role shares: limits, client TLS, max_inflight_kv, arenas, verify threads, stats
        self.transfer = TransferContext.for_role(config.limits, security.client_ssl(),
                                                config.transfer.max_inflight_kv)

    async def tokenize(self, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids, tokenised off the event loop, so a long prompt never stalls ``/health`` or other
        requests (``prfaas.services.tokenizing``)."""
        return await self.tokenizing.tokenize(body)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        """Holds a reservation of the sequence's KV bytes (prompt + max_tokens) while it runs, so the free KV
        memory in heartbeats is what new requests can really get."""
        need = self.fixed_bytes + self.bytes_per_token * (len(request.token_ids) + request.max_tokens)
        self.reserved_kv_bytes += need
        try:
            async for event in self._generate(request):
                yield event
        except PrfaasError as exc:
            yield Failed.of(exc)
        finally:
            self.reserved_kv_bytes -= need

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        sampling = request.sampling
        arrived = time.perf_counter()
        stages: dict[str, float] = {}
        if request.kv_id:
            try:
                kv = await self._pull(request)
            except BaseException:  # failed or cancelled (the client left): this consumer gives the blob up now
                await release_abandoned(request.kv_address, request.kv_id, ssl=self.transfer.client_ssl)
                raise
            stages["transfer_ms"] = (time.perf_counter() - arrived) * 1e3
            metrics.TRANSFER_SECONDS.observe(stages["transfer_ms"] / 1e3)
            prepare, step = (lambda: self._restore(request, kv)), 0
        else:
            prepare, step = (lambda: self._prefill(request, sampling, arrived)), request.step_offset
        seq = Sequence(seq_id=request.request_id, prepare=prepare, max_new=request.max_tokens, sampling=sampling,
                       step=step, eos=() if request.ignore_eos else self.engine.eos_token_ids,
                       loop=asyncio.get_running_loop())
        self.scheduler.submit(seq)
        released = {"done": not request.kv_id}
        try:
            async for event in self._events(request, seq, stages, released):
                yield event
        finally:
            seq.cancelled.set()  # done, stopped or abandoned: the slot is freed at the next step
            if not released["done"]:  # restore failed or the client left first: nobody will consume the blob
                await release_abandoned(request.kv_address, request.kv_id, ssl=self.transfer.client_ssl)

    async def _events(self, request: GenerateRequest, seq: Sequence, stages: dict[str, float],
                      released: dict[str, bool]) -> AsyncIterator[GenerateEvent]:
        text, count, reason = TextStream(self.engine.tokenizer, request.stop), 0, "length"
        while True:
            kind, *rest = await seq.out.get()
            if kind == "error":
                raise rest[0]
            if kind == "end":
                reason = "stop" if rest[0] == "stop" else "length"
                break
            token, extra = rest
            first: Stages | None = None
            if count == 0:
                if request.kv_id:  # the KV is in our model cache now: the store may delete it
                    released["done"] = True
                    await release(request.kv_address, request.kv_id, timeout_s=5.0, ssl=self.transfer.client_ssl)
                first = Stages(**{**stages, **extra})
            count += 1
            yield Token(token=token, text=text.feed(token), stages=first)
            if text.stopped:
                reason = "stop"
                break
        yield Done(finish_reason=reason, completion_tokens=count, text=text.flush())

    def _restore(self, request: GenerateRequest, kv: KVState) -> Iterator[Prepared | None]:
        """On the engine thread, which owns the prefix cache: a suffix-only blob is joined to the cached prefix it
        names (``KVPrefixMissing`` when it is not held), and the prompt's blocks are stored in the prefix cache, so
        the conversation's next turn finds its history here (salted with the request's tenant, as local prefills)."""
        started, first = time.perf_counter(), kv.first_token
        if first is None:
            raise InvalidRequest("the KV blob carries no first token")
        if kv.prefix is not None:
            if self.prefix is None:
                raise KVPrefixMissing("the blob extends a cached prefix, and this instance keeps no prefix cache")
            kv = self.prefix.extend(request.token_ids, request.tenant, kv)
        cache = self.engine.restore(kv)
        if self.prefix is not None and kv.seq_len == len(request.token_ids):
            self.prefix.keep(request.token_ids, request.tenant, kv)
        yield cache, first, kv.seq_len, {"restore_ms": (time.perf_counter() - started) * 1e3}

    def _prefill(self, request: GenerateRequest, sampling: SamplingParams,
                 arrived: float) -> Iterator[Prepared | None]:
        started = time.perf_counter()
        chunk_tokens = self.scheduler.local_chunk(self.config.prefill.prefill_chunk_tokens)  # on the engine thread
        if self.prefix is not None:
            work = self.prefix.chunks(request.token_ids, request.tenant, chunk_tokens, sampling, request.step_offset)
        else:
            work = self.engine.prefill_chunks(request.token_ids, chunk_tokens, sampling, request.step_offset)
        for result in work:
            if result is None:
                yield None
                continue
            cache, first, seconds = result
            stages = {"queue_ms": (started - arrived) * 1e3, "prefill_ms": seconds * 1e3}
            yield cache, first, len(request.token_ids), stages

    async def _pull(self, request: GenerateRequest) -> KVState:
        deadline = time.monotonic() + CREATION_GRACE_S
        timeout_s = self.config.transfer.kv_transfer_timeout_ms / 1e3 + 10.0
        while True:
            try:
                reader = BlobReader(retain=self.keeps_kv, limits=self.transfer.limits, pool=self.frames)
                kv = await pull(request.kv_address, request.kv_id, reader, timeout_s=timeout_s,
                                retries=self.config.transfer.kv_retry_budget,
                                streams=self.config.transfer.transfer_streams,
                                context=self.transfer)
                metrics.TRANSFER_BYTES.inc(kv.nbytes)
                return kv
            except KVNotFound:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.01)

    def load(self) -> dict[str, int]:
        budget = self.config.store.store_budget_bytes
        try:
            used = max(self.reserved_kv_bytes, self.scheduler.batch.kv_bytes())
        except RuntimeError:  # the engine thread was changing the batch: the reservation is a fine estimate
            used = self.reserved_kv_bytes
        used += self.prefix.cache.nbytes if self.prefix else 0  # the prefix cache's memory is not free
        return {"queue_depth": self.scheduler.queue_depth, "free_kv_bytes": max(0, budget - used),
                "kv_budget_bytes": budget, "kv_bytes_per_token": self.bytes_per_token,
                "kv_fixed_bytes": self.fixed_bytes}

    def tcp_peers(self) -> list[TcpPeer]:
        """``TCP_INFO`` of this instance's pulls, per store address (``prfaas.transfer.stats``)."""
        return self.transfer.stats.pull.peers()

    def close(self) -> None:
        self.scheduler.close()
        self.tokenizing.close()
        self.transfer.close()
