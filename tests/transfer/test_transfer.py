from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from prfaas.errors import KVBadFormat, KVCorrupt, KVExpired, KVNotFound, KVStoreFull, KVUnavailable
from prfaas.kv import BlobReader, LayerState
from prfaas.store import BlobStore
from prfaas.transfer import TransferServer, pull, push, release, stat
from prfaas.transfer import protocol as p
from prfaas.transfer.wire import Conn
from tests.transfer.helpers import assert_clean, assert_same, blob_frames, fill, make_state, run

MiB = 1 << 20


class Served:
    """A store behind a ``TransferServer`` on 127.0.0.1, for ``async with``."""

    def __init__(self, budget: int = 64 * MiB, ttl_s: float = 120.0, **kw: Any) -> None:
        self.store = BlobStore(budget, ttl_s, **kw)
        self.server = TransferServer(self.store)
        self.address = ""

    async def __aenter__(self) -> Served:
        self.address = f"127.0.0.1:{await self.server.start()}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.close()


def test_messages_round_trip_and_bad_ones_are_refused() -> None:
    for message in (p.Put("x", 1), p.Get("x", 3, 300), p.Release("x"), p.Stat(), p.Ok(), p.Error("KV_TIMEOUT", "m")):
        frame = p.encode(message)
        assert p.decode(frame[9:]) == message
    assert isinstance(p.Error("KV_CORRUPT", "bad").exception(), KVCorrupt)
    import msgpack

    for body in ([2, "get", {"kv_id": "x", "from_chunk": 0, "wait_ms": 1}], [1, "nope", {}],
                 [1, "get", {"kv_id": "x", "from_chunk": "0", "wait_ms": 1}], [1, "get", {"kv_id": "x"}], "junk"):
        with pytest.raises(KVBadFormat):
            p.decode(msgpack.packb(body))


def test_push_then_pull_is_bit_exact_and_release_leaves_nothing() -> None:
    state = make_state()
    kv_id, frames = blob_frames(state)

    async def scenario() -> None:
        async with Served() as relay:
            await push(relay.address, kv_id, frames, timeout_s=2.0)
            assert (await stat(relay.address))["ready"] == 1
            for _ in range(2):  # re-reads are idempotent until release
                got = await pull(relay.address, kv_id, BlobReader(), timeout_s=2.0)
                assert_same(state, got)
                assert got.kv_id == kv_id
            record = await release(relay.address, kv_id, timeout_s=2.0)
            assert (record["kv_id"], record["reason"], record["chunks"]) == (kv_id, "released", len(frames) - 2)
            with pytest.raises(KVNotFound):
                await release(relay.address, kv_id)
            with pytest.raises(KVNotFound):
                await pull(relay.address, kv_id, BlobReader(), timeout_s=2.0)
            assert (await stat(relay.address))["blobs"] == 0
            assert_clean(relay.store)

    run(scenario)


def test_decode_pulls_while_prefill_is_still_pushing() -> None:
    state = make_state(layers=8)
    kv_id, frames = blob_frames(state)
    pushed = asyncio.Event()

    async def producer() -> AsyncIterator[bytes]:
        for frame in frames:
            yield frame
            await asyncio.sleep(0.003)  # layers finish one by one

    async def scenario() -> None:
        async with Served() as relay:
            async def prefill() -> None:
                await push(relay.address, kv_id, producer(), timeout_s=2.0)
                pushed.set()

            arrivals: list[bool] = []

            def on_layers(layers: list[LayerState]) -> None:
                arrivals.extend(pushed.is_set() for _ in layers)

            task = asyncio.create_task(prefill())
            while relay.store.stats().blobs == 0:
                await asyncio.sleep(0.001)
            got = await pull(relay.address, kv_id, BlobReader(), timeout_s=2.0, on_layers=on_layers)
            await task
            assert_same(state, got)
            assert len(arrivals) == len(state.layers) and not arrivals[0]  # layers arrived before the push ended
            await release(relay.address, kv_id)
            assert_clean(relay.store)

    run(scenario)


def test_errors_cross_the_wire_with_their_codes() -> None:
    kv_id, frames = blob_frames(make_state())
    clock = [0.0]

    async def scenario() -> None:
        async with Served(ttl_s=60, clock=lambda: clock[0]) as relay:
            fill(relay.store, kv_id, frames)
            clock[0] = 61.0
            with pytest.raises(KVExpired):
                await pull(relay.address, kv_id, BlobReader(), timeout_s=1.0)
            with pytest.raises(KVNotFound):
                await pull(relay.address, blob_frames(make_state(seed=3))[0], BlobReader(), timeout_s=1.0)
            assert relay.server.connections == 2  # neither was retried
            assert_clean(relay.store)
        with pytest.raises(KVUnavailable):
            await pull(relay.address, kv_id, BlobReader(), timeout_s=0.5, retries=1, backoff_s=0.01)

    run(scenario)


def test_push_over_budget_is_refused_and_leaves_no_partial_blob() -> None:
    kv_id, frames = blob_frames(make_state())

    async def scenario() -> None:
        async with Served(budget=MiB) as relay:
            with pytest.raises(KVStoreFull):
                await push(relay.address, kv_id, frames, timeout_s=2.0)
            assert [r.reason for r in relay.store.records] == ["aborted"]
            assert_clean(relay.store)

    run(scenario)


def test_push_of_a_damaged_chunk_is_refused() -> None:
    kv_id, frames = blob_frames(make_state())
    damaged = bytearray(frames[3])
    damaged[100] ^= 1

    async def scenario() -> None:
        async with Served() as relay:
            with pytest.raises(KVCorrupt):
                await push(relay.address, kv_id, [*frames[:3], bytes(damaged), *frames[4:]], timeout_s=2.0)
            assert_clean(relay.store)

    run(scenario)


def test_closing_the_server_ends_waiting_readers() -> None:
    kv_id, frames = blob_frames(make_state())

    async def scenario() -> None:
        relay = Served()
        async with relay:
            relay.store.create(kv_id, frames[0])
            task = asyncio.create_task(pull(relay.address, kv_id, BlobReader(), timeout_s=5.0, retries=0))
            while relay.store.stats().readers == 0:
                await asyncio.sleep(0.005)
        with pytest.raises(Exception) as info:
            await task
        assert getattr(info.value, "code", "") in ("KV_TRUNCATED", "KV_UNAVAILABLE")
        assert relay.store.stats().readers == 0
        relay.store.close()
        assert_clean(relay.store)

    run(scenario)


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\n\r\n", b"M\xff\xff\xff\xff\x00\x00\x00\x00",
                                     p.encode(p.Put("x", 100)) + b"C" + bytes(40), p.encode(p.Ok())])
def test_garbage_gets_an_error_code_and_the_connection_is_closed(garbage: bytes) -> None:
    async def scenario() -> None:
        async with Served() as relay:
            host, port = relay.address.split(":")
            conn = await Conn.open(host, int(port), None)
            await conn.sendall(garbage)
            async with asyncio.timeout(2.0):
                reply = await p.read_message(conn)
                assert isinstance(reply, p.Error) and reply.code in ("KV_CORRUPT", "KV_BAD_FORMAT", "INVALID_REQUEST")
                assert await conn.recv_into(memoryview(bytearray(16))) == 0  # the server hung up
            conn.close()
            assert_clean(relay.store)

    run(scenario)


def test_a_busy_server_answers_unavailable() -> None:
    kv_id, frames = blob_frames(make_state())

    async def scenario() -> None:
        store = BlobStore(64 * MiB, 120)
        server = TransferServer(store, max_connections=1)
        address = f"127.0.0.1:{await server.start()}"
        store.create(kv_id, frames[0])
        waiting = asyncio.create_task(pull(address, kv_id, BlobReader(), timeout_s=2.0))
        while store.stats().readers == 0:
            await asyncio.sleep(0.005)
        with pytest.raises(KVUnavailable, match="busy"):
            await stat(address)
        for frame in frames[1:-1]:
            store.append(kv_id, frame)
        store.finish(kv_id, frames[-1])
        await waiting
        store.release(kv_id)
        await server.close()
        assert_clean(store)

    run(scenario)
