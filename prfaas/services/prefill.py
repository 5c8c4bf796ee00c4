"""The prefill role (datacenter A): turns token ids into a KV blob and the first token, never decodes further.

Chunks leave while the forward pass is still running: a hook after each decoder layer snapshots that layer,
encodes it and hands the finished chunk frames to the sink (own store, or a push to the relay). Prompts go through
one engine thread (``PrefillScheduler``): short ones queued together share a forward pass (``prefill_max_batch``,
``prefill_batch_tokens``), a long one runs ``prefill_chunk_tokens`` at a time, alternating with the short batches.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from prfaas.config import PrefillConfig, TransferConfig
from prfaas.errors import PrfaasError
from prfaas.events import Accepted, Failed, PrefillDone, PrefillEvent
from prfaas.kv import FORMAT_VERSION, BlobHeader, BlobWriter, LayerState, check_kv_id
from prfaas.kv.fingerprint import negotiate_version
from prfaas.kv.format import PREFIX_VERSION
from prfaas.kv.frames import FRAME_POOL_BYTES, FramePool
from prfaas.kv.prefix import pool_tenant
from prfaas.kv.state import PrefixRef
from prfaas.kv.suffix import cut
from prfaas.messages import PrefillRequest, SamplingParams, TcpPeer
from prfaas.obs import metrics
from prfaas.security.runtime import PLAINTEXT, Security
from prfaas.services.fair_queue import FairSlots
from prfaas.services.prefill_scheduler import PrefillJob, PrefillScheduler
from prfaas.services.sinks import FrameSink, PushSink, StoreSink
from prfaas.store import BlobStore
from prfaas.tenancy.clusters import DEFAULT_POLICY, ClusterPolicy
from prfaas.transfer import TransferContext

if TYPE_CHECKING:  # the protocol's name only: importing prfaas.engine at run time loads torch
    from prfaas.engine.prefix_prefill import PrefixPrefill
    from prfaas.engine.protocol import Engine


class PrefillService:
    """Owns a blob from ``accepted`` until its trailer is written; then the store owns it."""

    def __init__(self, engine: Engine, config: PrefillConfig, transfer: TransferConfig, store: BlobStore | None,
                 security: Security = PLAINTEXT, prefix: PrefixPrefill | None = None) -> None:
        self.engine = engine
        self.client_ssl = security.client_ssl()  # the role's TLS for its pushes to the relay
        self.pushes = TransferContext(client_ssl=self.client_ssl)  # every push's stats (relay mode's TCP_INFO)
        self.transfer = transfer
        self.store = store
        self.prefix = prefix  # the engine's prefix cache (docs/prefix-cache.md); None: off
        self.scheduler = PrefillScheduler(engine, config.prefill_max_batch, config.prefill_batch_tokens,
                                          config.prefill_chunk_tokens, prefix)
        self._slots = FairSlots(transfer.max_inflight_kv)  # blobs in flight, shared fairly by client clusters
        self.frames = FramePool(FRAME_POOL_BYTES)  # pushes' chunk frames, reused once sent (prfaas.kv.frames)

    async def prefill(self, request: PrefillRequest, cluster: ClusterPolicy = DEFAULT_POLICY
                      ) -> AsyncIterator[PrefillEvent]:
        """NDJSON events: ``accepted`` once the blob exists, then ``done`` (first token, sizes) or ``error``.
        ``cluster``'s share and priority place the prompt in the engine's fair queue."""
        arrived = time.perf_counter()
        try:
            async with self._slots.slot(cluster):
                async for event in self._prefill(request, arrived, cluster):
                    yield event
        except PrfaasError as exc:
            yield Failed.of(exc)

    async def _prefill(self, request: PrefillRequest, arrived: float,
                       cluster: ClusterPolicy) -> AsyncIterator[PrefillEvent]:
        sampling = request.sampling
        self.engine.check_prompt(request.token_ids)  # a prompt the engine refuses is refused before `accepted`
        version = negotiate_version([request.format_version]) if request.format_version else FORMAT_VERSION
        # a push lets its frames go once sent, so they can be reused; a store keeps its own copy
        writer = BlobWriter(self._header(request, version), version, self.frames if request.push_to else None)
        sink = self._sink(request, writer.header_frame())
        started = time.perf_counter()
        done = self._submit(request.token_ids, sampling, writer, sink, cluster,
                            pool_tenant(cluster.name, request.tenant))  # runs while the relay creates the blob
        try:
            await sink.ready()  # the blob exists where decode reads it: decode's first Get finds it
            yield Accepted()
            first_token, seconds, began = await done
            await sink.finish(writer.finish(first_token))
        except BaseException:
            done.cancel()  # its outcome no longer matters (the engine finishes the job; its frames are dropped)
            await sink.abort("aborted")
            raise
        metrics.PREFILL_SECONDS.observe(seconds)
        yield PrefillDone(first_token=first_token, kv_bytes=writer.bytes_written, chunks=writer.chunks_written,
                          prefill_ms=seconds * 1e3, queue_ms=(max(began, started) - arrived) * 1e3)

    def _submit(self, token_ids: list[int], sampling: SamplingParams, writer: BlobWriter,
                sink: FrameSink, cluster: ClusterPolicy, tenant: str) -> asyncio.Future[tuple[int, float, float]]:
        """Queue the prompt on the engine thread; the future settles with (first token, seconds, when it left the
        queue for the engine) or its error."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[int, float, float]] = loop.create_future()

        extends = writer.header.prefix

        def on_layer(layer: LayerState) -> None:  # engine thread: blocks while a push is too far behind
            if extends is not None:  # decode holds the prefix: only the positions after it travel
                whole, layer = layer.nbytes, cut(layer, extends.tokens, len(token_ids))
                metrics.PREFIX_WAN_SAVED.labels("prefill").inc(whole - layer.nbytes)
            sink.hand_over(writer.add_layer(layer))

        def finish(token: int | None, seconds: float, error: BaseException | None) -> None:
            def settle() -> None:
                if done.done():
                    return
                if error is not None:
                    done.set_exception(error)
                else:
                    done.set_result((int(token or 0), seconds, job.started))
            loop.call_soon_threadsafe(settle)

        job = PrefillJob(list(token_ids), sampling, on_layer, finish, cluster, tenant)
        self.scheduler.submit(job)
        return done

    def _header(self, request: PrefillRequest, version: int) -> BlobHeader:
        fingerprint = self.engine.fingerprint  # carries the version written, so old readers accept the blob
        if version != fingerprint.format_version:
            fingerprint = dataclasses.replace(fingerprint, format_version=version)
        return BlobHeader(kv_id=check_kv_id(request.kv_id), fingerprint=fingerprint,
                          codec=request.kv_codec or self.transfer.kv_codec,
                          seq_len=len(request.token_ids), cache=self.engine.cache_class,
                          chunk_size=self.transfer.chunk_bytes, layers=self.engine.layer_table,
                          created_ms=int(time.time() * 1000), prefix=self._extends(request, version))

    def _extends(self, request: PrefillRequest, version: int) -> PrefixRef | None:
        """The prefix the blob leaves out: the one the router says the decode instance holds, when a reader at
        ``version`` understands a suffix-only blob and this engine keeps KV (a synthetic one ships sizes only)."""
        if not request.prefix_tokens or version < PREFIX_VERSION or not self.engine.keeps_kv:
            return None
        return PrefixRef(chain_hash=request.prefix_hash, tokens=request.prefix_tokens)

    def _sink(self, request: PrefillRequest, header: bytes) -> FrameSink:
        if request.push_to:
            timeout = self.transfer.kv_transfer_timeout_ms / 1e3 + 30.0
            return PushSink(request.push_to, request.kv_id, header, timeout, tls=self.client_ssl, tenant=request.tenant,
                            ttl_s=request.kv_ttl_seconds, context=self.pushes)
        assert self.store is not None, "direct mode needs the prefill's own store"
        return StoreSink(self.store, request.kv_id, header, request.tenant, request.kv_ttl_seconds)

    def tcp_peers(self) -> list[TcpPeer]:
        """``TCP_INFO`` of this instance's pushes, per relay address (``prfaas.transfer.stats``)."""
        return self.pushes.stats.push.peers()

    def load(self) -> dict[str, int]:
        free = self.store.stats().budget_bytes - self.store.stats().bytes if self.store else 0
        cached = self.prefix.cache.nbytes if self.prefix else 0  # the prefix cache's memory is not free
        return {"queue_depth": self.scheduler.queue_depth, "free_kv_bytes": max(0, free - cached)}

    def close(self) -> None:
        self.scheduler.close()
