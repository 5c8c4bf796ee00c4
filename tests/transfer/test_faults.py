"""Pulls through a fault-injecting proxy: cuts, resets, flipped bytes and stalls either heal by resuming from the
last verified chunk (bit-exact result) or fail with the right code within the deadline and the retry budget."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from prfaas.errors import KVCorrupt, KVTimeout, KVTruncated, PrfaasError
from prfaas.kv import BlobReader, KVState
from prfaas.kv.format import CHUNK_HEAD_SIZE
from prfaas.store import BlobStore
from prfaas.transfer import TransferServer, pull
from prfaas.transfer import protocol as p
from tests.transfer.helpers import Fault, FaultProxy, assert_clean, assert_same, blob_frames, fill, make_state, run

STATE = make_state()
KV_ID, FRAMES = blob_frames(STATE)


def offset_in_chunk(index: int, into: int) -> int:
    """Byte offset, in a Get's server → client stream, of byte ``into`` of chunk ``index``'s data."""
    return len(p.encode(p.Ok())) + sum(map(len, FRAMES[:index + 1])) + CHUNK_HEAD_SIZE + into


def through_proxy(plan: Callable[[int], Fault | None], retries: int, timeout_s: float = 1.0
                  ) -> tuple[KVState | PrfaasError, int, list[int], float]:
    """Pull ``KV_ID`` through a proxy; returns the state (or the error), connections made, the chunk each retry
    resumed from, and the seconds it took. Checks that the store is left clean."""
    resumed: list[int] = []

    async def scenario() -> tuple[KVState | PrfaasError, int, list[int], float]:
        store = BlobStore(64 << 20, 120)
        fill(store, KV_ID, FRAMES)
        server = TransferServer(store)
        proxy = FaultProxy(await server.start(), plan)
        address = f"127.0.0.1:{await proxy.start()}"
        reader = BlobReader()
        start = time.monotonic()
        result: KVState | PrfaasError
        try:
            result = await pull(address, KV_ID, reader, timeout_s=timeout_s, retries=retries, backoff_s=0.01,
                                on_retry=lambda n, exc: resumed.append(reader.next_chunk))
        except PrfaasError as exc:
            result = exc
        elapsed = time.monotonic() - start
        await proxy.close()
        await server.close()
        assert store.stats().readers == 0
        store.release(KV_ID)
        assert_clean(store)
        return result, proxy.connections, resumed, elapsed

    return run(scenario)


def once(fault: Fault) -> Callable[[int], Fault | None]:
    return lambda n: fault if n == 0 else None


@pytest.mark.parametrize("reset", [False, True])
def test_cut_mid_stream_resumes_from_the_last_verified_chunk(reset: bool) -> None:
    result, connections, resumed, _ = through_proxy(once(Fault(cut_after=offset_in_chunk(20, 500), reset=reset)),
                                                    retries=2)
    assert isinstance(result, KVState)
    assert_same(STATE, result)
    assert connections == 2 and len(resumed) == 1
    if reset:  # an RST discards what the kernel held unread, so the resume point depends on how far we had read
        assert 0 < resumed[0] <= 20
    else:
        assert resumed == [20]  # chunks 0–19 were kept, not fetched again


def test_corrupt_chunk_is_fetched_again_never_used() -> None:
    result, connections, resumed, _ = through_proxy(once(Fault(flip_at=offset_in_chunk(7, 1000))), retries=2)
    assert isinstance(result, KVState)
    assert_same(STATE, result)
    assert connections == 2 and resumed == [7]


def test_damaged_chunk_head_is_caught_too() -> None:
    result, _, resumed, _ = through_proxy(once(Fault(flip_at=offset_in_chunk(9, -10))), retries=1)
    assert isinstance(result, KVState) and resumed == [9]
    assert_same(STATE, result)


def test_corruption_on_every_try_fails_corrupt_within_the_budget() -> None:
    result, connections, resumed, _ = through_proxy(lambda n: Fault(flip_at=offset_in_chunk(5, 10)), retries=2)
    assert isinstance(result, KVCorrupt)
    assert connections == 3 and len(resumed) == 2  # offsets count per connection: 5, then 10


def test_stall_times_out_within_the_deadline() -> None:
    timeout_s, retries = 0.3, 1
    result, connections, _, elapsed = through_proxy(lambda n: Fault(stall_after=offset_in_chunk(n + 3, 0)),
                                                    retries=retries, timeout_s=timeout_s)
    assert isinstance(result, KVTimeout)
    assert connections == retries + 1
    assert elapsed < (retries + 1) * timeout_s + 0.5  # one per-chunk timeout per try, plus backoff and slack


def test_a_stall_then_a_good_connection_completes() -> None:
    result, connections, resumed, _ = through_proxy(once(Fault(stall_after=offset_in_chunk(12, 0))), retries=1,
                                                    timeout_s=0.3)
    assert isinstance(result, KVState) and connections == 2 and resumed == [12]
    assert_same(STATE, result)


@pytest.mark.parametrize("retries", [0, 1, 3])
def test_retries_never_exceed_the_budget(retries: int) -> None:
    result, connections, resumed, _ = through_proxy(lambda n: Fault(cut_after=offset_in_chunk(2 * n, 0)),
                                                    retries=retries)
    assert isinstance(result, KVTruncated)
    assert connections == retries + 1 and len(resumed) == retries
