"""``FramePool``: a writer's chunk frames in reused buffers, never one that something still holds."""

from __future__ import annotations

import gc

import numpy as np

from prfaas.kv import BlobWriter, KVState, LayerState, decode_state
from prfaas.kv.format import CHUNK_HEAD_SIZE, state_frames
from prfaas.kv.frames import FramePool
from tests.kv.test_format import FP, assert_same, make_state

CHUNK = 4096
FRAME = CHUNK_HEAD_SIZE + CHUNK


def layered(layers: int = 16, tokens: int = 32) -> KVState:
    """Layers of about two chunks each: a layer's frames are all the writer holds at once."""
    rng = np.random.default_rng(layers)
    return KVState(FP, tokens, [LayerState(i, "full_attention", True, None, {
        "keys": rng.standard_normal((1, 2, tokens, 16), dtype=np.float32),
        "values": rng.standard_normal((1, 2, tokens, 16), dtype=np.float32)}) for i in range(layers)], first_token=3)


def test_frames_let_go_are_reused_and_the_blob_is_exact() -> None:
    state, pool = layered(), FramePool(4 * FRAME)
    blob, addresses = bytearray(), set()
    for frame in state_frames(BlobWriter.for_state(state, chunk_size=CHUNK, pool=pool), state):
        blob += frame  # sent, then let go, as a push does
        addresses.add(id(frame))
        del frame
    assert_same(state, decode_state(blob))
    assert len(blob) // FRAME > 4  # more full chunks than the pool holds buffers ...
    assert pool.reused >= len(blob) // FRAME - 4  # ... all of them in its buffers
    assert 0 < pool.held_bytes <= 4 * FRAME


def test_a_frame_still_held_is_never_written_again() -> None:
    pool = FramePool(64 * FRAME)
    first, second = make_state(tokens=400, seed=1), make_state(tokens=400, seed=2)
    kept = list(state_frames(BlobWriter.for_state(first, chunk_size=CHUNK, pool=pool), first))
    copies = [bytes(f) for f in kept]
    assert any(isinstance(f, bytearray) for f in kept)  # some came from the pool
    for frame in state_frames(BlobWriter.for_state(second, chunk_size=CHUNK, pool=pool), second):
        del frame
    assert [bytes(f) for f in kept] == copies
    assert_same(first, decode_state(b"".join(kept)))


def test_a_view_of_a_frame_holds_it_too() -> None:
    pool = FramePool(FRAME)
    buffer = pool.take(FRAME)
    assert buffer is not None
    view = memoryview(buffer)
    del buffer
    assert pool.take(FRAME) is None  # the only buffer is still seen through ``view``, and the pool is full
    view.release()
    gc.collect()
    assert pool.take(FRAME) is not None and pool.reused == 1


def test_past_its_bound_frames_are_new_memory() -> None:
    state, pool = make_state(tokens=400), FramePool(2 * FRAME)
    kept = list(state_frames(BlobWriter.for_state(state, chunk_size=CHUNK, pool=pool), state))
    assert sum(isinstance(f, bytearray) for f in kept) == 2
    assert pool.held_bytes == 2 * FRAME
    assert_same(state, decode_state(b"".join(kept)))


def test_another_chunk_size_replaces_the_free_buffers() -> None:
    pool = FramePool(8 * FRAME)
    held = pool.take(FRAME)
    assert pool.take(FRAME) is not None  # made, then let go
    bigger = pool.take(2 * FRAME)
    assert bigger is not None and len(bigger) == 2 * FRAME
    assert pool.held_bytes == 3 * FRAME  # the free small one went; the held one stays counted until let go
    del held
    assert pool.take(2 * FRAME) is not None
    assert pool.held_bytes == 2 * FRAME + 2 * FRAME
