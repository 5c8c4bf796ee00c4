"""The checks a store makes on the frames a writer hands it, before anything is stored."""

from __future__ import annotations

import xxhash

from prfaas.errors import KVBadFormat, KVCorrupt, KVTruncated
from prfaas.kv.format import CHUNK_HEAD_SIZE, BlobHeader, BlobTrailer, parse_chunk_head, parse_header, parse_trailer
from prfaas.limits import DEFAULT as DEFAULT_LIMITS
from prfaas.limits import WireLimits
from prfaas.store.blob import Blob


def header(kv_id: str, header_frame: bytes, limits: WireLimits = DEFAULT_LIMITS) -> tuple[BlobHeader, bytes]:
    """The parsed header and the exact frame. ``KVBadFormat`` if incomplete or naming another blob."""
    try:
        parsed, frame = parse_header(header_frame, limits)
    except KVTruncated as exc:
        raise KVBadFormat(f"incomplete header frame for {kv_id}") from exc
    if parsed.kv_id != kv_id:
        raise KVBadFormat(f"header frame names {parsed.kv_id}, not {kv_id}")
    return parsed, frame


def chunk(kv_id: str, chunk_frame: bytes, limits: WireLimits = DEFAULT_LIMITS) -> tuple[int, int]:
    """``(index, payload length)`` of a chunk frame whose payload matches its length and xxHash64."""
    index, length, checksum = parse_chunk_head(chunk_frame[:CHUNK_HEAD_SIZE], limits)
    data = memoryview(chunk_frame)[CHUNK_HEAD_SIZE:]
    if len(data) != length or xxhash.xxh64_intdigest(data) != checksum:
        raise KVCorrupt(f"chunk {index} of {kv_id} failed its length or xxHash64 check")
    return index, length


def in_order(blob: Blob, index: int, length: int) -> None:
    if index != blob.chunks or length > blob.chunk_size:
        raise KVBadFormat(f"chunk {index} ({length} bytes) out of order or over the chunk size")


def trailer(blob: Blob, trailer_frame: bytes, limits: WireLimits = DEFAULT_LIMITS) -> BlobTrailer:
    """The parsed trailer; ``KVCorrupt`` if it disagrees with the chunks the store holds."""
    parsed = parse_trailer(trailer_frame, limits)
    if parsed.chunk_count != blob.chunks or parsed.total_bytes != blob.payload:
        raise KVCorrupt(f"trailer of {blob.kv_id} says {parsed.chunk_count} chunks / {parsed.total_bytes} "
                        f"bytes; the store holds {blob.chunks} / {blob.payload}")
    return parsed
