"""Many concurrent requests' pulls through a fault-injecting proxy (delays, stalls, resets, truncation, byte flips)
on striped connections: each one returns exactly the blob that was written or fails with a transport error code
within its deadline; retries stay within the per-request budget and the role's cap; nothing is left in the
store, no task and no socket."""

from __future__ import annotations

import asyncio
import random
import time

from prfaas.errors import PrfaasError
from prfaas.kv import BlobReader, KVState
from prfaas.store import BlobStore
from prfaas.transfer import TransferContext, TransferServer, blob_deadline_s, pull, stats
from tests.transfer.helpers import Fault, FaultProxy, assert_clean, assert_same, blob_frames, fill, make_state, run

REQUESTS, RETRIES, TIMEOUT_S, STREAMS = 12, 2, 0.4, 2
TRANSPORT_CODES = {"KV_TIMEOUT", "KV_CORRUPT", "KV_TRUNCATED", "KV_UNAVAILABLE"}


def fault_for(rng: random.Random) -> Fault | None:
    at = rng.randrange(2_000, 600_000)
    return rng.choice([None, None, Fault(delay_s=0.002), Fault(stall_after=at), Fault(cut_after=at, reset=True),
                       Fault(cut_after=at), Fault(flip_at=at)])


def test_every_request_is_exact_or_fails_with_the_right_code_and_nothing_leaks() -> None:
    states = [make_state(layers=4, tokens=128, seed=i) for i in range(REQUESTS)]
    blobs = [blob_frames(s, chunk_size=32 << 10) for s in states]
    rng = random.Random(4)
    plans = [fault_for(rng) for _ in range(200)]
    retries: list[int] = [0] * REQUESTS
    context = TransferContext()  # one role's pulls: one retry cap

    async def one(i: int, address: str) -> tuple[KVState | PrfaasError, float, float]:
        kv_id, frames = blobs[i]
        chunks = len(frames) - 2
        deadline = blob_deadline_s(chunks, 32 << 10, 300) + (RETRIES + 1) * (TIMEOUT_S + 0.2)
        start = time.monotonic()

        def count(n: int, exc: PrfaasError) -> None:
            retries[i] = n

        try:
            result: KVState | PrfaasError = await pull(address, kv_id, BlobReader(), timeout_s=TIMEOUT_S,
                                                       retries=RETRIES, streams=STREAMS, deadline_s=deadline,
                                                       backoff_s=0.01, on_retry=count, context=context)
        except PrfaasError as exc:
            result = exc
        return result, time.monotonic() - start, deadline

    async def scenario() -> None:
        store = BlobStore(256 << 20, 120)
        for kv_id, frames in blobs:
            fill(store, kv_id, frames)
        server = TransferServer(store)
        proxy = FaultProxy(await server.start(), lambda n: plans[n % len(plans)])
        address = f"127.0.0.1:{await proxy.start()}"
        outcomes = await asyncio.gather(*(one(i, address) for i in range(REQUESTS)))
        await proxy.close()
        await server.close()
        for state, (result, elapsed, deadline) in zip(states, outcomes, strict=True):
            if isinstance(result, PrfaasError):
                assert result.code in TRANSPORT_CODES, result
                assert elapsed <= deadline + 1.0  # failed within its deadline (plus scheduling slack)
            else:
                assert_same(state, result)
        assert all(n <= RETRIES for n in retries)
        health = context.stats.pull.health()
        assert health.transfers == REQUESTS and health.retries <= max(stats.MIN_RETRIES, REQUESTS // 100)
        assert sum(retries) == health.retries
        assert any(not isinstance(r, PrfaasError) for r, _, _ in outcomes)
        assert store.stats().readers == 0
        for kv_id, _ in blobs:
            store.release(kv_id)
        assert_clean(store)

    run(scenario, timeout_s=60)


def test_max_inflight_bounds_concurrent_pulls() -> None:
    state = make_state(layers=2, tokens=64)
    kv_id, frames = blob_frames(state)

    async def scenario() -> None:
        store = BlobStore(64 << 20, 120)
        fill(store, kv_id, frames)
        server = TransferServer(store)
        address = f"127.0.0.1:{await server.start()}"
        context = TransferContext(inflight=stats.InflightLimit(2))
        limit = context.inflight
        assert limit is not None
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, limit.inflight)
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        got = await asyncio.gather(*(pull(address, kv_id, BlobReader(), timeout_s=2.0, context=context)
                                     for _ in range(6)))
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await server.close()
        assert 1 <= peak <= 2 and limit.inflight == 0
        for result in got:
            assert_same(state, result)
        store.release(kv_id)
        assert_clean(store)

    run(scenario)
