"""``BlobReader(retain=False)``: every byte verified and parsed, nothing kept (engines that need only sizes)."""

from __future__ import annotations

import numpy as np
import pytest

from prfaas.errors import KVCorrupt, KVTruncated
from prfaas.kv import BlobReader, BlobWriter
from prfaas.kv.format import CHUNK_HEAD_SIZE, parse_chunk_head
from tests.kv.test_format import make_state
from tests.kv.test_format_arena import _frames


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_layers_keep_their_shapes_dtypes_and_sizes_but_no_bytes(codec: str) -> None:
    state = make_state(tokens=120)
    writer = BlobWriter.for_state(state, codec=codec, chunk_size=4096)
    frames = [writer.header_frame(), *(f for layer in state.layers for f in writer.add_layer(layer)),
              *writer.finish(state.first_token)]
    kept, dropped = BlobReader(), BlobReader(retain=False)
    for reader in (kept, dropped):
        reader.feed(b"".join(frames))
    full, light = kept.state(), dropped.state()
    assert (light.seq_len, light.first_token, light.nbytes) == (full.seq_len, full.first_token, full.nbytes)
    for a, b in zip(full.layers, light.layers, strict=True):
        assert (a.index, a.kind, a.attrs) == (b.index, b.kind, b.attrs)
        for name, tensor in a.tensors.items():
            other = b.tensors[name]
            assert (other.shape, other.dtype, other.nbytes) == (tensor.shape, tensor.dtype, tensor.nbytes)
            assert not other.flags.writeable and all(s == 0 for s in other.strides)  # a placeholder, no memory


def test_a_damaged_chunk_is_still_corrupt_and_an_early_end_truncated() -> None:
    frames, _ = _frames()
    index, length, checksum = parse_chunk_head(frames[1][:CHUNK_HEAD_SIZE])
    reader = BlobReader(retain=False)
    reader.feed(frames[0])
    damaged = bytearray(frames[1][CHUNK_HEAD_SIZE:])
    damaged[length // 2] ^= 0x10
    with pytest.raises(KVCorrupt):
        reader.feed_chunk(index, bytes(damaged), checksum)
    assert reader.next_chunk == 0
    reader.feed(b"".join(frames[1:-1]))
    with pytest.raises(KVTruncated):
        reader.state()


def test_a_reader_that_keeps_nothing_takes_no_arena() -> None:
    arena = np.zeros(1 << 20, dtype=np.uint8)
    assert not BlobReader(retain=False).use_arena(arena)
    with pytest.raises(ValueError):
        BlobReader(arena=arena, retain=False)
