from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
import xxhash

from prfaas.errors import KVBadFormat, KVCorrupt, KVIncompatible, KVTooLarge, KVTruncated, PrfaasError
from prfaas.kv import BlobReader, BlobWriter, Fingerprint, KVState, LayerState, decode_state, encode_state
from prfaas.kv.format import MAGIC

FP = Fingerprint("m", "llama", "a" * 16, "b" * 16, "float32", 8192)


def make_state(tokens: int = 50, seed: int = 0) -> KVState:
    rng = np.random.default_rng(seed)
    layers = [
        LayerState(0, "full_attention", True, None, {
            "keys": rng.standard_normal((1, 2, tokens, 16), dtype=np.float32),
            "values": rng.standard_normal((1, 2, tokens, 16), dtype=np.float32)}),
        LayerState(1, "linear_attention", False, None, {
            "conv_states.0": rng.standard_normal((1, 128, 4)).astype(ml_dtypes.bfloat16),
            "recurrent_states.0": rng.standard_normal((1, 4, 16, 16), dtype=np.float32)},
            {"conv_kernel_size": {0: 4}, "has_previous_state": {0: True}, "__class__": "LinearAttentionLayer"}),
        LayerState(2, "none", False),
        LayerState(3, "sliding_attention", False, 8, {
            "keys": rng.standard_normal((1, 2, 7, 16)).astype(np.float16),
            "values": rng.standard_normal((1, 2, 7, 16)).astype(np.float16)}, {"cumulative_length": tokens}),
    ]
    return KVState(FP, tokens, layers, first_token=7)


def assert_same(a: KVState, b: KVState) -> None:
    assert (a.fingerprint, a.seq_len, a.first_token, a.cache) == (b.fingerprint, b.seq_len, b.first_token, b.cache)
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert la.table_entry() == lb.table_entry()
        assert la.attrs == lb.attrs
        assert la.tensors.keys() == lb.tensors.keys()
        for name in la.tensors:
            assert la.tensors[name].dtype == lb.tensors[name].dtype
            assert la.tensors[name].tobytes() == lb.tensors[name].tobytes()


@pytest.mark.parametrize("chunk_size", [4096, 8192, 1 << 20])
def test_none_round_trip_is_bit_exact(chunk_size: int) -> None:
    state = make_state()
    blob = encode_state(state, "none", chunk_size=chunk_size)
    back = decode_state(blob)
    assert_same(state, back)
    assert back.kv_id and back.kv_id.startswith(FP.short_hash())
    assert back.nbytes == state.nbytes


def test_stream_yields_layers_as_chunks_arrive() -> None:
    state = make_state(tokens=400)
    blob = encode_state(state, "none", chunk_size=4096)
    reader, seen = BlobReader(), []
    for i in range(0, len(blob), 1000):
        seen.append(len(reader.feed(blob[i:i + 1000])))
        if not reader.done:
            with pytest.raises(KVTruncated):
                reader.state()
    assert sum(seen) == len(state.layers)
    assert seen.index(1) < len(seen) - 1  # the first layer was usable before the blob ended
    assert_same(state, reader.state())


def test_every_damaged_byte_is_detected() -> None:
    blob = encode_state(make_state(tokens=20), "none", chunk_size=4096)
    codes = set()
    for i in range(len(blob)):
        damaged = bytearray(blob)
        damaged[i] ^= 0x04
        with pytest.raises(PrfaasError) as info:
            decode_state(bytes(damaged))
        expected = KVBadFormat if i < len(MAGIC) else KVCorrupt
        assert isinstance(info.value, expected), (i, info.value)
        codes.add(info.value.code)
    assert codes == {"KV_BAD_FORMAT", "KV_CORRUPT"}


def test_truncation_anywhere_is_truncated() -> None:
    blob = encode_state(make_state(), "none", chunk_size=4096)
    for n in [*range(0, len(blob), 257), len(blob) - 1]:
        with pytest.raises(KVTruncated):
            decode_state(blob[:n])


def test_wrong_magic_and_unknown_version() -> None:
    blob = encode_state(make_state())
    with pytest.raises(KVBadFormat, match="magic"):
        decode_state(b"GGUF" + blob[4:])
    head = struct.pack(">4sHI", MAGIC, 99, struct.unpack(">I", blob[6:10])[0])
    forged = head + struct.pack(">I", xxhash.xxh32_intdigest(head)) + blob[14:]
    with pytest.raises(KVBadFormat, match="unknown KV format version 99"):
        decode_state(forged)


def test_lengths_from_the_wire_are_limited() -> None:
    head = struct.pack(">4sHI", MAGIC, 1, 1 << 30)
    with pytest.raises(KVBadFormat, match="over the"):
        decode_state(head + struct.pack(">I", xxhash.xxh32_intdigest(head)))
    with pytest.raises(KVTooLarge):
        decode_state(encode_state(make_state(tokens=400), chunk_size=4096), max_bytes=10_000)


def test_data_after_trailer_is_refused() -> None:
    blob = encode_state(make_state())
    with pytest.raises(KVBadFormat, match="after the blob trailer"):
        decode_state(blob + b"C")


def test_chunks_out_of_order_are_refused() -> None:
    reader = BlobReader()
    reader.feed(BlobWriter.for_state(make_state()).header_frame())
    with pytest.raises(KVBadFormat, match="out of order"):
        reader.feed_chunk(3, b"x", xxhash.xxh64_intdigest(b"x"))


def test_fingerprint_mismatch_names_fields() -> None:
    other = Fingerprint("m", "llama", "c" * 16, "b" * 16, "bfloat16", 8192)
    assert FP.mismatches(other) == ["weights", "dtype"]
    with pytest.raises(KVIncompatible, match=r"weights.*dtype"):
        FP.check_compatible(other)
    FP.check_compatible(Fingerprint("renamed", "llama", "a" * 16, "b" * 16, "float32", 8192))
