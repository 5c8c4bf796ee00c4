"""Pulls receive into reused arenas: reuse happens only when nothing refers to the old blob, the pool is bounded,
and a pulled state stays intact while later pulls run."""

from __future__ import annotations

import numpy as np

from prfaas.kv import BlobReader, KVState
from prfaas.kv.frames import FramePool
from prfaas.store import BlobStore
from prfaas.transfer import TransferContext, TransferServer, pull, push, release
from prfaas.transfer.buffers import ArenaPool
from tests.transfer.helpers import assert_same, blob_frames, make_state, run

MiB = 1 << 20


def test_pool_reuses_only_arenas_nothing_refers_to() -> None:
    pool = ArenaPool(2)
    first = pool.take(MiB)
    view = first[10:20]
    assert pool.take(MiB) is not first  # ``first`` is still held
    del first
    second = pool.take(MiB)  # the view still refers to the first arena: the second one is free
    assert second.base is not view.base
    del second, view
    assert pool.in_use() == 0
    again = pool.take(MiB)
    assert pool.reused == 2 and pool.arenas == 2 and again.nbytes >= MiB


def test_pool_is_bounded_and_grows_a_free_arena_that_is_too_small() -> None:
    pool = ArenaPool(1)
    held = pool.take(MiB)
    extra = pool.take(MiB)  # the only tracked arena is in use: an untracked one
    assert pool.arenas == 1 and extra is not held
    del held, extra
    big = pool.take(8 * MiB)  # the free arena is too small: replaced, still one
    assert pool.arenas == 1 and big.nbytes >= 8 * MiB


def test_repeated_pulls_reuse_one_arena_and_earlier_states_stay_intact() -> None:
    states = [make_state(seed=s) for s in range(3)]
    blobs = [blob_frames(s) for s in states]
    context = TransferContext()  # the pulls of one role share its arenas
    pool = context.arenas

    async def scenario() -> None:
        server = TransferServer(BlobStore(64 * MiB, 60.0))
        address = f"127.0.0.1:{await server.start()}"
        try:
            for kv_id, frames in blobs:
                await push(address, kv_id, frames, timeout_s=5.0)
            kept = await pull(address, blobs[0][0], BlobReader(), timeout_s=5.0, context=context)
            arena = _arena_of(kept)
            for _ in range(2):  # ``kept`` is held: these use another arena, and then reuse it
                got = await pull(address, blobs[1][0], BlobReader(), timeout_s=5.0, context=context)
                assert _arena_of(got) is not arena
                assert_same(states[1], got)
                del got
            assert pool.reused >= 1 and pool.arenas == 2
            got = await pull(address, blobs[2][0], BlobReader(), timeout_s=5.0, streams=3, context=context)
            assert_same(states[2], got)
            assert_same(states[0], kept)  # untouched by the pulls that ran meanwhile
            del got, kept, arena
            assert pool.in_use() == 0  # every tensor was a view of its arena: dropping the state freed it
            for kv_id, _ in blobs:
                await release(address, kv_id)
        finally:
            await server.close()

    run(scenario)


def _arena_of(state: KVState) -> np.ndarray:
    tensor = next(t for layer in state.layers for t in layer.tensors.values())
    base = tensor.base
    while isinstance(base, np.ndarray) and base.base is not None and isinstance(base.base, np.ndarray):
        base = base.base
    assert isinstance(base, np.ndarray)
    return base


def test_a_burst_does_not_pin_its_peak_memory() -> None:
    pool = ArenaPool(4)
    burst = [pool.take(MiB) for _ in range(4)]
    assert pool.arenas == 4
    del burst
    again = pool.take(MiB)  # one reused, one spare kept, the other two unmapped
    assert pool.arenas == 2 and pool.reused == 1 and again.nbytes >= MiB


def test_a_store_receives_pushes_into_buffers_released_blobs_left_and_never_into_a_held_one() -> None:
    states = [make_state(layers=4, tokens=256, seed=s) for s in range(4)]
    blobs = [blob_frames(s, chunk_size=64 << 10) for s in states]
    reader_pool = FramePool(8 << 20)

    async def scenario() -> None:
        server = TransferServer(BlobStore(64 * MiB, 60.0))
        address = f"127.0.0.1:{await server.start()}"
        try:
            await push(address, blobs[0][0], blobs[0][1], timeout_s=5.0)  # held by the store throughout
            made = server.frames.held_bytes
            for kv_id, frames in blobs[1:]:  # each released before the next arrives
                await push(address, kv_id, frames, timeout_s=5.0)
                index = blobs.index((kv_id, frames))
                assert_same(states[index], await pull(address, kv_id, BlobReader(), timeout_s=5.0))
                # a reader that keeps nothing receives into its own pool's buffers, reused chunk after chunk
                kept_nothing = await pull(address, kv_id, BlobReader(retain=False, pool=reader_pool), timeout_s=5.0)
                assert kept_nothing.nbytes == states[index].nbytes
                await release(address, kv_id)
            assert server.frames.reused >= 2 * (len(blobs[1][1]) - 3)  # the last two blobs: the first one's buffers
            assert server.frames.held_bytes <= 2 * made
            assert reader_pool.reused > 0 and reader_pool.held_bytes < 8 << 20
            assert_same(states[0], await pull(address, blobs[0][0], BlobReader(), timeout_s=5.0))  # intact
            await release(address, blobs[0][0])
        finally:
            await server.close()

    run(scenario)
