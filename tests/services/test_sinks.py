"""The relay-mode sink against real sockets: ``ready()`` returns once the relay holds the blob (so decode's first
Get finds it), and frames waiting for a slow relay stay within the queue's bound: back-pressure on the producing
thread, then a refusal, never unbounded growth."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from prfaas.errors import KVTimeout
from prfaas.kv import BlobReader, BlobWriter, KVState
from prfaas.kv.format import CHUNK_HEAD_SIZE
from prfaas.kv.frames import FramePool
from prfaas.services.sinks import PushSink
from prfaas.store import BlobStore
from prfaas.transfer import TransferServer, pull, release
from tests.transfer.helpers import assert_clean, assert_same, blob_frames, make_state, run

KiB, MiB = 1 << 10, 1 << 20


def test_ready_means_the_relay_holds_the_blob_and_a_bounded_push_delivers_it_whole() -> None:
    state = make_state(layers=8, tokens=512)
    kv_id, frames = blob_frames(state, chunk_size=16 * KiB)
    assert len(frames) > 20

    async def scenario() -> None:
        store = BlobStore(64 * MiB, 60.0)
        server = TransferServer(store)
        address = f"127.0.0.1:{await server.start()}"
        try:
            sink = PushSink(address, kv_id, frames[0], timeout_s=5.0, tls=None, max_queued_bytes=32 * KiB)
            await sink.ready()
            assert store.stats().blobs == 1  # before a single chunk was handed over
            producer = threading.Thread(target=sink.hand_over, args=(frames[1:-3],))
            producer.start()
            while producer.is_alive():
                assert sink.queued_bytes <= 32 * KiB + 17 * KiB
                await asyncio.sleep(0.001)
            await sink.finish(frames[-3:])
            assert_same(state, await pull(address, kv_id, BlobReader(), timeout_s=5.0))
            await release(address, kv_id)
            assert_clean(store)
        finally:
            await server.close()

    run(scenario)


def test_frames_the_engine_thread_handed_over_go_before_the_trailer_however_late_the_loop_wakes() -> None:
    state = make_state(layers=4, tokens=64)
    kv_id, frames = blob_frames(state, chunk_size=4 * KiB)

    async def scenario() -> None:
        store = BlobStore(64 * MiB, 60.0)
        server = TransferServer(store)
        address = f"127.0.0.1:{await server.start()}"
        try:
            sink = PushSink(address, kv_id, frames[0], timeout_s=5.0, tls=None)
            await sink.ready()
            producer = threading.Thread(target=sink.hand_over, args=(frames[1:-2],))
            producer.start()
            producer.join()  # the loop has not run a single callback of the hand-over yet
            await sink.finish(frames[-2:])
            assert_same(state, await pull(address, kv_id, BlobReader(), timeout_s=5.0))
            await release(address, kv_id)
            assert_clean(store)
        finally:
            await server.close()

    run(scenario)


def test_pooled_frames_are_reused_once_sent_and_every_blob_arrives_exact() -> None:
    pool = FramePool(24 * (16 * KiB + CHUNK_HEAD_SIZE))  # 24 of a blob's 512 chunks

    def encode(writer: BlobWriter, sink: PushSink, state: KVState) -> None:
        for layer in state.layers:
            sink.hand_over(writer.add_layer(layer))

    async def scenario() -> None:
        store = BlobStore(64 * MiB, 60.0)
        server = TransferServer(store)
        address = f"127.0.0.1:{await server.start()}"
        try:
            for seed in range(3):
                state = make_state(layers=8, tokens=512, seed=seed)
                writer = BlobWriter.for_state(state, chunk_size=16 * KiB, pool=pool)
                kv_id = writer.header.kv_id
                sink = PushSink(address, kv_id, writer.header_frame(), timeout_s=5.0, tls=None,
                                max_queued_bytes=64 * KiB)
                await sink.ready()
                producer = threading.Thread(target=encode, args=(writer, sink, state))  # the engine thread
                producer.start()
                while producer.is_alive():
                    await asyncio.sleep(0.001)
                await sink.finish(writer.finish(state.first_token))
                assert_same(state, await pull(address, kv_id, BlobReader(), timeout_s=5.0))
                await release(address, kv_id)
            # each layer's 64 chunks are handed over in one list: the pool's 24 buffers serve the first of them,
            # freed again by the time the next layer comes (the queue holds 4), in every blob but the first's start
            assert pool.reused >= 3 * 8 * 16 and pool.held_bytes <= pool.max_bytes
            assert_clean(store)
        finally:
            await server.close()

    run(scenario)


def test_a_relay_that_stops_reading_bounds_the_queue_then_refuses_the_push() -> None:
    frame = b"C" + bytes(256 * KiB - 1)  # never parsed: the peer reads nothing
    limit, timeout_s = 1 * MiB, 1.0

    async def scenario() -> None:
        held: list[asyncio.StreamWriter] = []

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(writer)  # keep the connection open, read nothing

        server = await asyncio.start_server(accept, "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            sink = PushSink(address, "kv", b"P" + bytes(100), timeout_s=timeout_s, tls=None, max_queued_bytes=limit)
            producer = threading.Thread(target=sink.hand_over, args=([frame] * 200,))  # 50 MiB offered
            started, peak = time.monotonic(), 0
            producer.start()
            while producer.is_alive():
                peak = max(peak, sink.queued_bytes)
                assert time.monotonic() - started < timeout_s + 5.0, "the producer was never released"
                await asyncio.sleep(0.005)
            assert limit // 2 <= peak <= limit + len(frame)  # it filled up to the bound, and no further
            with pytest.raises(KVTimeout):
                await sink.finish([b"T" + bytes(10)])
        finally:
            for writer in held:
                writer.close()
            server.close()
            await server.wait_closed()

    run(scenario)
