"""``BlobReader`` with an arena: chunks at ``index × chunk_size``, tensors as views of it, same checks as without."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from prfaas.errors import KVBadFormat, KVCorrupt, KVTooLarge, PrfaasError
from prfaas.kv import BlobReader, BlobWriter
from prfaas.kv.format import CHUNK_HEAD_SIZE, parse_chunk_head, state_frames
from tests.kv.test_format import assert_same, make_state


def _frames(chunk_size: int = 4096) -> tuple[list[bytes], object]:
    state = make_state(tokens=120)
    return list(state_frames(BlobWriter.for_state(state, chunk_size=chunk_size), state)), state


def test_fed_bytes_land_in_the_arena_and_tensors_are_views_of_it() -> None:
    frames, state = _frames()
    arena = np.zeros(1 << 20, dtype=np.uint8)
    reader = BlobReader(arena=arena)
    reader.feed(b"".join(frames))
    got = reader.state()
    assert_same(state, got)  # type: ignore[arg-type]
    views = [t for layer in got.layers for t in layer.tensors.values() if np.shares_memory(t, arena)]
    assert views, "no tensor is a view of the arena"


def test_chunks_received_in_place_are_not_copied() -> None:
    frames, state = _frames()
    arena = np.zeros(1 << 20, dtype=np.uint8)
    reader = BlobReader(arena=arena)
    reader.feed(frames[0])
    for frame in frames[1:-1]:
        index, length, checksum = parse_chunk_head(frame[:CHUNK_HEAD_SIZE])
        place = reader.chunk_view(index, length)
        place[:] = frame[CHUNK_HEAD_SIZE:]  # what a transport's recv_into does
        reader.feed_chunk(index, place, checksum)
    reader.feed(frames[-1])
    assert_same(state, reader.state())  # type: ignore[arg-type]


def test_every_damaged_payload_byte_is_corrupt_with_an_arena() -> None:
    frames, _ = _frames()
    chunk = frames[1]
    index, length, checksum = parse_chunk_head(chunk[:CHUNK_HEAD_SIZE])
    for i in range(0, length, 97):
        reader = BlobReader(arena=np.zeros(1 << 20, dtype=np.uint8))
        reader.feed(frames[0])
        damaged = bytearray(chunk[CHUNK_HEAD_SIZE:])
        damaged[i] ^= 0x01
        with pytest.raises(KVCorrupt):
            reader.feed_chunk(index, bytes(damaged), checksum)
        assert reader.next_chunk == 0  # nothing was used: the chunk can be fetched again
        reader.feed_chunk(index, chunk[CHUNK_HEAD_SIZE:], checksum)


def test_a_short_chunk_before_the_last_and_an_arena_overflow_are_refused() -> None:
    frames, _ = _frames()
    reader = BlobReader(arena=np.zeros(1 << 20, dtype=np.uint8))
    reader.feed(frames[0])
    short = frames[1][CHUNK_HEAD_SIZE:CHUNK_HEAD_SIZE + 100]
    reader.feed_chunk(0, short, xxhash.xxh64_intdigest(short))
    with pytest.raises(KVBadFormat, match="short chunk"):
        reader.feed_chunk(1, short, xxhash.xxh64_intdigest(short))
    small = BlobReader(arena=np.zeros(6000, dtype=np.uint8))
    small.feed(frames[0])
    with pytest.raises(KVTooLarge):
        small.chunk_view(1, 4096)
    with pytest.raises(PrfaasError):
        small.feed(b"".join(frames[1:]))


def test_an_arena_is_taken_only_before_the_first_chunk() -> None:
    frames, _ = _frames()
    reader = BlobReader()
    reader.feed(frames[0] + frames[1])
    assert not reader.use_arena(np.zeros(1 << 20, dtype=np.uint8))
    assert reader.arena is None
