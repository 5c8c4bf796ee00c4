"""The KV blob: a versioned, checksummed, chunked binary format (no pickle; msgpack for the small headers).

::

    header   "PRKV" u16 version u32 n u32 h  msgpack{kv_id, fingerprint, codec, seq_len, cache, chunk_size,
                                              layers: [{index, kind, grows, window}], created_ms,
                                              [prefix: {chain_hash, tokens}]}  u64 xxh64
    chunk    "C" u32 index u32 length u64 xxh64(data) u32 h  data      (repeated; ≤ chunk_size each)
    trailer  "T" u32 n u32 h  msgpack{total_bytes, chunk_count, payload_xxh64, first_token}  u64 xxh64

``h`` is the xxHash32 of the frame head before it, so every byte of a blob is covered by a checksum: a damaged
byte anywhere is ``KV_CORRUPT`` (a damaged magic is ``KV_BAD_FORMAT``: not a blob at all).

The chunks cut one payload stream, which holds the layers in order; a layer is ``u32 n, msgpack{index, kind,
grows, window, attrs, tensors: [desc]}`` followed by each tensor's wire parts. A chunk is cut as soon as it is full,
so chunks of early layers leave while later layers are still being computed. Every length read from the wire is
checked against limits before anything is allocated.

Version 2 added ``prefix``: a suffix-only blob (``prfaas.kv.suffix``) names the cached prefix it extends, so a
version-1 reader, which would take it for a whole prompt's KV, refuses every version-2 blob; a version-1 header
never carries it. The header's own xxHash64 covers it like every other field.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import xxhash

from prfaas.errors import KVBadFormat, KVCorrupt, KVIncompatible, KVTooLarge, KVTruncated
from prfaas.kv import codecs
from prfaas.kv.fingerprint import FORMAT_VERSION, SUPPORTED_VERSIONS, Fingerprint
from prfaas.kv.frames import FramePool
from prfaas.kv.kvid import check_kv_id, new_kv_id
from prfaas.kv.state import DEFAULT_CHUNK_BYTES, LAYER_KINDS, KVState, LayerState, PrefixRef
from prfaas.limits import DEFAULT as DEFAULT_LIMITS
from prfaas.limits import MIN_CHUNK, WireLimits

MAGIC = b"PRKV"
_HEADER = struct.Struct(">4sHI")
_CHUNK = struct.Struct(">cIIQ")
_TRAILER = struct.Struct(">cI")
_HEAD_SUM = struct.Struct(">I")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_HEX = "0123456789abcdef"
PREFIX_VERSION = 2  # the first blob format whose header may name the prefix a suffix-only blob extends


@dataclass(frozen=True)
class BlobHeader:
    kv_id: str
    fingerprint: Fingerprint
    codec: str
    seq_len: int
    cache: str
    chunk_size: int
    layers: tuple[dict[str, Any], ...]
    created_ms: int
    prefix: PrefixRef | None = None  # a suffix-only blob: the cached prefix it extends (format version 2 on)

    def to_wire(self) -> dict[str, Any]:
        wire = {"kv_id": self.kv_id, "fingerprint": self.fingerprint.to_wire(), "codec": self.codec,
                "seq_len": self.seq_len, "cache": self.cache, "chunk_size": self.chunk_size,
                "layers": list(self.layers), "created_ms": self.created_ms}
        return wire if self.prefix is None else {**wire, "prefix": self.prefix.to_wire()}

    @classmethod
    def from_wire(cls, data: Any, limits: WireLimits = DEFAULT_LIMITS) -> BlobHeader:
        """The header of decoded msgpack ``data``; ``KVBadFormat`` for a missing field or one over ``limits``."""
        try:
            layers = tuple(_check_table_entry(e) for e in data["layers"])
            header = cls(kv_id=check_kv_id(data["kv_id"]), fingerprint=Fingerprint.from_wire(data["fingerprint"]),
                         codec=codecs.check_codec(data["codec"]), seq_len=int(data["seq_len"]),
                         cache=str(data["cache"]), chunk_size=int(data["chunk_size"]), layers=layers,
                         created_ms=int(data["created_ms"]), prefix=_prefix_ref(data.get("prefix")))
        except (KeyError, TypeError, ValueError) as exc:
            raise KVBadFormat(f"bad blob header: {exc!r}") from exc
        except Exception as exc:
            if isinstance(exc, KVBadFormat):
                raise
            raise KVBadFormat(f"bad blob header: {exc}") from exc
        if not MIN_CHUNK <= header.chunk_size <= limits.max_chunk_bytes or len(layers) > limits.max_layers \
                or header.seq_len < 0:
            raise KVBadFormat("blob header field out of limits (chunk_size, layer count or seq_len)")
        if header.prefix is not None and not 0 < header.prefix.tokens < header.seq_len:
            raise KVBadFormat(f"blob header's prefix of {header.prefix.tokens} tokens is not inside its "
                              f"{header.seq_len}")
        return header


def _prefix_ref(data: Any) -> PrefixRef | None:
    if data is None:
        return None
    chain_hash = data["chain_hash"]
    if not isinstance(chain_hash, str) or len(chain_hash) != 32 or set(chain_hash) - set(_HEX):
        raise KVBadFormat("blob header's prefix chain hash is not 32 hex digits")
    return PrefixRef(chain_hash=chain_hash, tokens=int(data["tokens"]))


@dataclass(frozen=True)
class BlobTrailer:
    total_bytes: int
    chunk_count: int
    payload_xxh64: int
    first_token: int | None


def _check_table_entry(entry: Any) -> dict[str, Any]:
    if not isinstance(entry, dict) or entry.get("kind") not in LAYER_KINDS:
        raise KVBadFormat(f"bad layer table entry {str(entry)[:100]}")
    window = entry.get("window")
    return {"index": int(entry["index"]), "kind": entry["kind"], "grows": bool(entry["grows"]),
            "window": None if window is None else int(window)}


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes | memoryview) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise KVBadFormat(f"undecodable msgpack field: {exc}") from exc


Frame = bytes | bytearray  # a writer's frame: a pooled chunk frame is its buffer (prfaas.kv.frames)


class BlobWriter:
    """Builds a blob incrementally: ``header_frame()``, then ``add_layer()`` per layer, then ``finish()``.

    ``add_layer`` returns the chunk frames that became complete, so a caller can send them at once. With a
    ``pool`` (``prfaas.kv.frames``), full chunk frames are its reused ``bytearray`` buffers: a caller drops each
    one once sent, and must not keep it past that if it wants the memory reused.
    """

    def __init__(self, header: BlobHeader, version: int = 0, pool: FramePool | None = None) -> None:
        """``version``: the blob format to write (0: the current one); see ``negotiate_version``."""
        self.header = header
        self.version = version or FORMAT_VERSION
        if self.version not in SUPPORTED_VERSIONS:
            raise KVBadFormat(f"cannot write KV format version {self.version}; this writer supports "
                              f"{sorted(SUPPORTED_VERSIONS)}")
        if header.prefix is not None and self.version < PREFIX_VERSION:
            raise KVBadFormat(f"a suffix-only blob needs KV format version {PREFIX_VERSION}; asked for {self.version}")
        self._pending = bytearray()
        self._index = 0
        self._total = 0
        self._hash = xxhash.xxh64()
        self._frame_bytes = 0
        self._pool = pool

    @classmethod
    def for_state(cls, state: KVState, codec: str = "none", kv_id: str | None = None,
                  chunk_size: int = DEFAULT_CHUNK_BYTES, pool: FramePool | None = None) -> BlobWriter:
        header = BlobHeader(
            kv_id=kv_id or state.kv_id or new_kv_id(state.fingerprint.short_hash()),
            fingerprint=state.fingerprint, codec=codecs.check_codec(codec), seq_len=state.seq_len,
            cache=state.cache, chunk_size=chunk_size, layers=tuple(x.table_entry() for x in state.layers),
            created_ms=int(time.time() * 1000), prefix=state.prefix)
        return cls(header, pool=pool)

    @property
    def chunks_written(self) -> int:
        return self._index

    @property
    def bytes_written(self) -> int:
        """Every byte of every frame produced so far (header, chunk heads and data, trailer)."""
        return self._frame_bytes

    def header_frame(self) -> bytes:
        meta = _pack(self.header.to_wire())
        frame = _sealed(_HEADER.pack(MAGIC, self.version, len(meta))) + meta + _U64.pack(xxhash.xxh64_intdigest(meta))
        self._frame_bytes += len(frame)
        return frame

    def add_layer(self, layer: LayerState) -> list[Frame]:
        encoded = [codecs.encode(name, arr, self.header.codec, layer.role(name)) for name, arr in
                   layer.tensors.items()]
        meta = _pack({**layer.table_entry(), "attrs": layer.attrs, "tensors": [e.desc for e in encoded]})
        self._pending += _U32.pack(len(meta))
        self._pending += meta
        for enc in encoded:
            for part in enc.parts:
                self._pending += np.ascontiguousarray(part).view(np.uint8).reshape(-1).data
        return self._cut(final=False)

    def finish(self, first_token: int | None) -> list[Frame]:
        frames = self._cut(final=True)
        meta = _pack({"total_bytes": self._total, "chunk_count": self._index,
                      "payload_xxh64": self._hash.intdigest(), "first_token": first_token})
        frames.append(_sealed(_TRAILER.pack(b"T", len(meta))) + meta + _U64.pack(xxhash.xxh64_intdigest(meta)))
        self._frame_bytes += len(frames[-1])
        return frames

    def _cut(self, final: bool) -> list[Frame]:
        size, off, frames = self.header.chunk_size, 0, []
        view = memoryview(self._pending)
        while len(view) - off >= size or (final and off < len(view)):
            data = view[off:off + size]
            off += len(data)
            frame = self._frame(chunk_frame_head(self._index, data), data)
            frames.append(frame)
            self._frame_bytes += len(frame)
            self._hash.update(data)
            self._index += 1
            self._total += len(data)
            data.release()
        view.release()
        del self._pending[:off]
        return frames

    def _frame(self, head: bytes, data: memoryview) -> Frame:
        """``head`` + ``data`` in one buffer: for a full chunk the pool's, when it has one free, else new memory."""
        pool = self._pool if len(data) == self.header.chunk_size else None
        buffer = pool.take(len(head) + len(data)) if pool is not None else None
        if buffer is None:
            return b"".join((head, data))
        with memoryview(buffer) as view:  # a bytearray's own slice assignment would copy ``data`` twice
            view[:len(head)] = head
            view[len(head):] = data
        return buffer


def chunk_frame_head(index: int, data: bytes | memoryview) -> bytes:
    return _sealed(_CHUNK.pack(b"C", index, len(data), xxhash.xxh64_intdigest(data)))


CHUNK_HEAD_SIZE = _CHUNK.size + _HEAD_SUM.size


def _sealed(head: bytes) -> bytes:
    return head + _HEAD_SUM.pack(xxhash.xxh32_intdigest(head))


def _unsealed(view: memoryview, st: struct.Struct, what: str) -> tuple[Any, ...] | None:
    """Unpack a frame head after checking its own checksum; None if it is not complete yet."""
    if len(view) < st.size + _HEAD_SUM.size:
        return None
    head = view[:st.size]
    (checksum,) = _HEAD_SUM.unpack(view[st.size:st.size + _HEAD_SUM.size])
    if xxhash.xxh32_intdigest(head) != checksum:
        raise KVCorrupt(f"damaged {what} frame head")
    return st.unpack(head)


class BlobReader:
    """Parses a blob fed in arbitrary pieces; verifies every chunk before its bytes are used.

    Every chunk's xxHash64 is checked, and the trailer's chunk count and total bytes (the trailer has its own
    checksum), so a damaged byte anywhere is ``KVCorrupt``; the trailer's ``payload_xxh64`` (written, kept by the
    stores in their deletion records) is not recomputed over the payload a second time: with every chunk verified
    in order it could only repeat what the chunk checks already proved, at the cost of hashing every byte twice.

    Memory: by default each layer's bytes are copied once, into a buffer of its own. With an ``arena`` (a uint8
    array, e.g. from ``prfaas.transfer.buffers``) chunk ``i`` lives at payload offset ``i × chunk_size`` in it: a
    transport receives it there directly (``chunk_view``) and the layers' tensors are views of the arena, so no
    payload byte is copied at all (a chunk fed from elsewhere is copied into its place). Every chunk but the last
    must then be full, as ``BlobWriter`` cuts them.

    With ``retain=False`` (an engine that keeps no KV, such as the synthetic ones) every byte is still received,
    verified and parsed, but nothing is kept: each layer comes out with read-only zero-stride placeholders of its
    decoded dtype and shape (``nbytes`` as sent), so a blob of gigabytes streams through a few chunk buffers.

    ``feed`` returns the layers completed so far, so decode can restore layer by layer while chunks still arrive.
    ``next_chunk`` is where a resumed read starts. Errors: ``KVBadFormat`` (magic, version, limits, order),
    ``KVCorrupt`` (any checksum), ``KVTooLarge`` (over ``max_bytes``), ``KVTruncated`` (``state()`` before the
    trailer).

    ``limits``: the wire limits every length and count read is checked against (the role's ``config.limits``;
    the defaults when none are given); ``max_bytes`` defaults to its ``max_blob_bytes``.
    """

    def __init__(self, max_bytes: int | None = None, arena: np.ndarray | None = None, retain: bool = True,
                 limits: WireLimits = DEFAULT_LIMITS, pool: FramePool | None = None) -> None:
        """``pool``: where a chunk is received without an arena (``chunk_view``), reused once it is parsed."""
        if arena is not None and not retain:
            raise ValueError("a reader that keeps nothing takes no arena")
        self.limits = limits
        self._pool = pool
        self.max_bytes = limits.max_blob_bytes if max_bytes is None else max_bytes
        self.retain = retain
        self.header: BlobHeader | None = None
        self.trailer: BlobTrailer | None = None
        self.layers: list[LayerState] = []
        self.next_chunk = 0
        self._buf = bytearray()
        # no cycle: freed when dropped
        self._payload = _PayloadParser(self.layers, self.max_bytes, arena, retain, limits)
        self._total = 0

    @property
    def done(self) -> bool:
        return self.trailer is not None

    @property
    def arena(self) -> np.ndarray | None:
        return self._payload.arena

    def use_arena(self, arena: np.ndarray) -> bool:
        """Receive into ``arena`` from now on, if no chunk was fed yet and the reader has none; returns whether it
        was taken (a reader already under way keeps copying)."""
        if not self.retain or self._payload.arena is not None or self.next_chunk or self._payload.started:
            return False
        self._payload.arena = arena
        return True

    def chunk_view(self, index: int, length: int) -> memoryview:
        """Where chunk ``index`` of ``length`` bytes should be received: its place in the arena, or without one a
        buffer of the reader's pool (a full chunk's, when one is free) or a fresh one. ``KVBadFormat`` over the
        chunk size, ``KVTooLarge`` past ``max_bytes`` or the arena. Safe from another thread than the one feeding
        (it only reads the header)."""
        if self.header is None:
            raise KVBadFormat("chunk before the blob header")
        size = self.header.chunk_size
        if length > size:
            raise KVBadFormat(f"chunk {index} is {length} bytes, over the blob's chunk size")
        arena = self._payload.arena
        if arena is None:
            buffer = self._pool.take(length) if self._pool is not None and length == size else None
            return memoryview(buffer if buffer is not None else bytearray(length))
        start = index * size
        if start + length > min(len(arena), self.max_bytes):
            raise KVTooLarge(f"chunk {index} ends past the {min(len(arena), self.max_bytes)}-byte limit")
        return arena.data[start:start + length]

    def feed(self, data: bytes | bytearray | memoryview) -> list[LayerState]:
        if self.done and len(data):
            raise KVBadFormat("data after the blob trailer")
        self._buf += data
        before = len(self.layers)
        off = 0
        with memoryview(self._buf) as view:
            while not self.done:
                used = self._frame(view[off:])
                if used == 0:
                    break
                off += used
        del self._buf[:off]
        if self.done and self._buf:
            raise KVBadFormat("data after the blob trailer")
        return self.layers[before:]

    def feed_chunk(self, index: int, data: bytes | memoryview, checksum: int) -> list[LayerState]:
        """For transports that frame chunks themselves: one verified chunk of payload."""
        if self.header is None:
            raise KVBadFormat("chunk before the blob header")
        if index != self.next_chunk:
            raise KVBadFormat(f"chunk {index} out of order; expected {self.next_chunk}")
        if len(data) > self.header.chunk_size:
            raise KVBadFormat(f"chunk {index} is {len(data)} bytes, over the blob's chunk size")
        if xxhash.xxh64_intdigest(data) != checksum:
            raise KVCorrupt(f"chunk {index} failed its xxHash64 check")
        if self._total + len(data) > self.max_bytes:
            raise KVTooLarge(f"blob exceeds the {self.max_bytes}-byte limit")
        if self._payload.arena is not None:
            data = self._placed(index, data)
        self._total += len(data)
        self.next_chunk += 1
        before = len(self.layers)
        self._payload.feed(data)
        return self.layers[before:]

    def _placed(self, index: int, data: bytes | memoryview) -> memoryview:
        """``data`` at its place in the arena (copied there unless it was received there)."""
        assert self.header is not None
        if self._total != index * self.header.chunk_size:
            raise KVBadFormat(f"chunk {index} follows a short chunk (only the last may be short)")
        place = self.chunk_view(index, len(data))
        if len(data) and np.frombuffer(place, np.uint8).ctypes.data != np.frombuffer(data, np.uint8).ctypes.data:
            place[:] = data
        return place

    def resume_header(self, frame: bytes | bytearray | memoryview) -> None:
        """A resumed read re-sends the header frame: check that it describes the blob already being read (it is
        not fed again). Before any header was read it is simply fed. ``KVCorrupt``/``KVBadFormat`` if damaged,
        ``KVIncompatible`` if it is another blob's header."""
        if self.header is None:
            self.feed(parse_header(frame, self.limits)[1])
            return
        header, _ = parse_header(frame, self.limits)
        if header != self.header:
            raise KVIncompatible(f"resumed read of {self.header.kv_id} got the header of {header.kv_id}")

    def state(self) -> KVState:
        """The whole verified state; ``KVTruncated`` if the trailer has not arrived."""
        if self.header is None or self.trailer is None:
            raise KVTruncated(f"blob ended early after {self.next_chunk} chunks")
        return KVState(fingerprint=self.header.fingerprint, seq_len=self.header.seq_len, layers=self.layers,
                       cache=self.header.cache, first_token=self.trailer.first_token, kv_id=self.header.kv_id,
                       codec=self.header.codec, prefix=self.header.prefix)

    def _frame(self, view: memoryview) -> int:
        """Consume one frame from ``view`` if it is complete; returns the bytes used (0: need more)."""
        if self.header is None:
            return self._header_frame(view)
        if len(view) < 1:
            return 0
        tag = bytes(view[:1])
        if tag == b"C":
            head = _unsealed(view, _CHUNK, "chunk")
            if head is None:
                return 0
            _, index, length, checksum = head
            if length > self.header.chunk_size:
                raise KVCorrupt(f"chunk {index} claims {length} bytes, over the blob's chunk size")
            end = CHUNK_HEAD_SIZE + length
            if len(view) < end:
                return 0
            self.feed_chunk(index, view[CHUNK_HEAD_SIZE:end], checksum)
            return end
        if tag == b"T":
            return self._trailer_frame(view)
        raise KVCorrupt(f"damaged frame: unknown tag {tag!r}")

    def _header_frame(self, view: memoryview) -> int:
        if bytes(view[:len(MAGIC)]) != MAGIC[:min(len(view), len(MAGIC))]:
            raise KVBadFormat("not a prfaas KV blob (wrong magic)")
        head = _unsealed(view, _HEADER, "header")
        if head is None:
            return 0
        _, version, n = head
        if version not in SUPPORTED_VERSIONS:
            raise KVBadFormat(f"unknown KV format version {version}; this reader supports {sorted(SUPPORTED_VERSIONS)}")
        if n > self.limits.max_meta_bytes:
            raise KVBadFormat(f"blob header of {n} bytes is over the {self.limits.max_meta_bytes}-byte limit")
        start = _HEADER.size + _HEAD_SUM.size
        meta = _verified_meta(view[start:], n, "header")
        if meta is None:
            return 0
        header = BlobHeader.from_wire(_unpack(meta), self.limits)
        if header.prefix is not None and version < PREFIX_VERSION:
            raise KVBadFormat(f"a version-{version} blob header names a prefix (version {PREFIX_VERSION} on)")
        self.header = header
        return start + n + _U64.size

    def _trailer_frame(self, view: memoryview) -> int:
        head = _unsealed(view, _TRAILER, "trailer")
        if head is None:
            return 0
        _, n = head
        if n > self.limits.max_meta_bytes:
            raise KVBadFormat("blob trailer over its size limit")
        start = _TRAILER.size + _HEAD_SUM.size
        meta = _verified_meta(view[start:], n, "trailer")
        if meta is None:
            return 0
        data = _unpack(meta)
        try:
            trailer = BlobTrailer(int(data["total_bytes"]), int(data["chunk_count"]), int(data["payload_xxh64"]),
                                  None if data["first_token"] is None else int(data["first_token"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise KVBadFormat(f"bad blob trailer: {exc!r}") from exc
        self._check_trailer(trailer)
        self.trailer = trailer
        return start + n + _U64.size

    def _check_trailer(self, trailer: BlobTrailer) -> None:
        if trailer.chunk_count != self.next_chunk or trailer.total_bytes != self._total:
            raise KVCorrupt(f"trailer says {trailer.chunk_count} chunks / {trailer.total_bytes} bytes, "
                            f"received {self.next_chunk} / {self._total}")
        self._payload.close()
        assert self.header is not None
        if [x.index for x in self.layers] != [e["index"] for e in self.header.layers]:
            raise KVBadFormat("layers in the payload do not match the header's layer table")


def encode_state(state: KVState, codec: str = "none", kv_id: str | None = None,
                 chunk_size: int = DEFAULT_CHUNK_BYTES) -> bytes:
    """The whole blob of ``state`` (header, chunks, trailer) as one bytes object."""
    return b"".join(state_frames(BlobWriter.for_state(state, codec=codec, kv_id=kv_id, chunk_size=chunk_size),
                                 state))


def state_frames(writer: BlobWriter, state: KVState) -> Iterator[Frame]:
    """Every frame of ``state``'s blob in order, as ``writer`` (made for it) writes them: the header, each layer's
    chunks as the layer is added, the rest with the trailer."""
    yield writer.header_frame()
    for layer in state.layers:
        yield from writer.add_layer(layer)
    yield from writer.finish(state.first_token)


def decode_state(blob: bytes | bytearray | memoryview, max_bytes: int | None = None,
                 limits: WireLimits = DEFAULT_LIMITS) -> KVState:
    """Parse and verify a whole blob; raises ``KVCorrupt``, ``KVTruncated``, ``KVBadFormat`` or ``KVTooLarge``
    (over ``max_bytes``, default ``limits.max_blob_bytes``)."""
    reader = BlobReader(max_bytes=max_bytes, limits=limits)
    reader.feed(blob)
    return reader.state()


def _verified_meta(view: memoryview, n: int, what: str) -> memoryview | None:
    if len(view) < n + _U64.size:
        return None
    meta = view[:n]
    (checksum,) = _U64.unpack(view[n:n + _U64.size])
    if xxhash.xxh64_intdigest(meta) != checksum:
        raise KVCorrupt(f"blob {what} failed its xxHash64 check")
    return meta


class _PayloadParser:
    """Turns the verified payload stream back into ``LayerState`` objects as each layer completes.

    Without an arena each layer's bytes are copied exactly once, into a buffer preallocated from its layer record;
    with one, the data fed is the arena itself (``BlobReader._placed``) and a layer's buffer is the arena's slice
    where its bytes already are. The tensors are views of that buffer (codec ``none``) or decoded from it. Only
    the small layer records are staged.
    """

    def __init__(self, layers: list[LayerState], max_bytes: int, arena: np.ndarray | None,
                 retain: bool, limits: WireLimits) -> None:
        self.layers, self.max_bytes, self.arena, self.retain = layers, max_bytes, arena, retain
        self.limits = limits
        self.started = False
        self._pos = 0  # payload offset of the next byte fed
        self._head = bytearray()  # the current layer record (u32 n + msgpack), while incomplete
        self._meta: dict[str, Any] | None = None
        self._layouts: list[list[tuple[np.dtype, tuple[int, ...]]]] = []
        self._layer: np.ndarray | None = None
        self._need = 0  # bytes of the current layer
        self._filled = 0

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
        self.started = True
        off = 0
        while off < len(view):
            off += self._take_record(view[off:]) if self._meta is None else self._take_data(view[off:])
            if self._meta is not None and self._filled == self._need:
                self._end_layer()

    def close(self) -> None:
        if self._head or self._meta is not None:
            raise KVTruncated("payload ended inside a layer")

    def _layer_buffer(self) -> np.ndarray:
        assert self._layer is not None
        return self._layer

    def _take_record(self, view: memoryview) -> int:
        """Stage bytes of the next layer record; start the layer once it is whole. Returns the bytes used."""
        have = len(self._head)
        want = _U32.size if have < _U32.size else _U32.size + _U32.unpack_from(self._head)[0]
        used = min(want - have, len(view))
        self._head += view[:used]
        self._pos += used
        if len(self._head) == _U32.size:
            (n,) = _U32.unpack_from(self._head)
            if n > self.limits.max_meta_bytes:
                raise KVBadFormat(f"layer record of {n} bytes is over the limit")
        if len(self._head) > _U32.size and len(self._head) == want:
            self._begin_layer(_unpack(bytes(self._head[_U32.size:])))
            self._head.clear()
        return used

    def _take_data(self, view: memoryview) -> int:
        used = min(self._need - self._filled, len(view))
        if self.arena is None and self.retain:
            buf = self._layer_buffer()
            buf[self._filled:self._filled + used] = np.frombuffer(view[:used], dtype=np.uint8)
        self._filled += used
        self._pos += used
        return used

    def _begin_layer(self, meta: Any) -> None:
        if not isinstance(meta, dict) or not isinstance(meta.get("tensors"), list):
            raise KVBadFormat("bad layer record")
        if len(meta["tensors"]) > self.limits.max_tensors or len(self.layers) >= self.limits.max_layers:
            raise KVBadFormat("too many tensors or layers")
        self._layouts = [codecs.part_layout(desc) for desc in meta["tensors"]]
        need = sum(int(np.prod(shape, dtype=np.int64)) * dt.itemsize for lay in self._layouts for dt, shape in lay)
        if need > self.max_bytes:
            raise KVTooLarge(f"layer of {need} bytes exceeds the {self.max_bytes}-byte limit")
        if not self.retain:
            layer = None
        elif self.arena is None:
            layer = np.empty(need, dtype=np.uint8)
        elif self._pos + need > len(self.arena):
            raise KVTooLarge(f"layer of {need} bytes ends past the {len(self.arena)}-byte arena")
        else:
            layer = self.arena[self._pos:self._pos + need]  # where the chunks already put its bytes
        self._meta, self._layer, self._need, self._filled = meta, layer, need, 0

    def _end_layer(self) -> None:
        assert self._meta is not None
        meta, off, tensors = self._meta, 0, {}
        for desc, layout in zip(meta["tensors"], self._layouts, strict=True):
            if not self.retain:
                dims = tuple(int(d) for d in desc["shape"])
                tensors[str(desc["name"])] = np.broadcast_to(np.zeros((), codecs.dtype_of(desc["dtype"])), dims)
                continue
            raw = self._layer_buffer()
            parts = []
            for dt, shape in layout:
                n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                parts.append(raw[off:off + n].view(dt).reshape(shape))
                off += n
            tensors[str(desc["name"])] = codecs.decode(desc, parts)
        entry = _check_table_entry(meta)
        self.layers.append(LayerState(tensors=tensors, attrs=dict(meta.get("attrs") or {}), **entry))
        self._meta, self._layer, self._need, self._filled = None, None, 0, 0


# Frame-level parsing for transports that delimit frames on the wire (``prfaas.transfer``) and for stores that keep
# blobs as the frames they travel in (``prfaas.store``). Every function checks the frame's own checksums.

HEADER_HEAD_SIZE = _HEADER.size + _HEAD_SUM.size
TRAILER_HEAD_SIZE = _TRAILER.size + _HEAD_SUM.size
META_SUM_SIZE = _U64.size


def parse_chunk_head(head: bytes | bytearray | memoryview,
                     limits: WireLimits = DEFAULT_LIMITS) -> tuple[int, int, int]:
    """``(index, length, xxh64)`` from the first ``CHUNK_HEAD_SIZE`` bytes of a chunk frame.
    ``KVCorrupt`` if the head fails its checksum or is not a chunk head; ``KVTruncated`` if it is short;
    ``KVBadFormat`` if its length is over ``limits.max_chunk_bytes``."""
    parsed = _unsealed(memoryview(head), _CHUNK, "chunk")
    if parsed is None:
        raise KVTruncated("chunk frame head is incomplete")
    tag, index, length, checksum = parsed
    if tag != b"C":
        raise KVCorrupt(f"damaged frame: unknown tag {tag!r}")
    if length > limits.max_chunk_bytes:
        raise KVBadFormat(f"chunk {index} claims {length} bytes, over the limit ({limits.max_chunk_bytes})")
    return int(index), int(length), int(checksum)


def meta_length(head: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> int:
    """The msgpack length announced by a header (``HEADER_HEAD_SIZE`` bytes) or trailer (``TRAILER_HEAD_SIZE``)
    frame head; the whole frame is ``head + length + META_SUM_SIZE`` bytes. Checked against ``max_meta_bytes``."""
    view = memoryview(head)
    if bytes(view[:1]) == b"T":
        parsed = _unsealed(view, _TRAILER, "trailer")
        n = None if parsed is None else parsed[1]
    else:
        if bytes(view[:len(MAGIC)]) != MAGIC:
            raise KVBadFormat("not a prfaas KV blob (wrong magic)")
        parsed = _unsealed(view, _HEADER, "header")
        if parsed is not None and parsed[1] not in SUPPORTED_VERSIONS:
            raise KVBadFormat(f"unknown KV format version {parsed[1]}")
        n = None if parsed is None else parsed[2]
    if n is None:
        raise KVTruncated("frame head is incomplete")
    if n > limits.max_meta_bytes:
        raise KVBadFormat(f"frame metadata of {n} bytes is over the {limits.max_meta_bytes}-byte limit")
    return int(n)


def parse_header(frame: bytes | bytearray | memoryview,
                 limits: WireLimits = DEFAULT_LIMITS) -> tuple[BlobHeader, bytes]:
    """The header of one whole header frame, and the frame as bytes. Errors as ``BlobReader.feed``; a frame with
    bytes missing is ``KVTruncated``, one with extra bytes ``KVBadFormat``."""
    data = bytes(frame)
    reader = BlobReader(limits=limits)
    used = reader._header_frame(memoryview(data))
    if reader.header is None or used == 0:
        raise KVTruncated("header frame is incomplete")
    if used != len(data):
        raise KVBadFormat("bytes after the header frame")
    return reader.header, data


def parse_trailer(frame: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> BlobTrailer:
    """The trailer of one whole trailer frame, its checksums verified (not yet compared with any payload)."""
    view = memoryview(bytes(frame))
    head = _unsealed(view, _TRAILER, "trailer")
    if head is None or head[0] != b"T":
        raise KVBadFormat("not a trailer frame")
    start = TRAILER_HEAD_SIZE
    if head[1] > limits.max_meta_bytes or len(view) != start + head[1] + _U64.size:
        raise KVBadFormat("trailer frame length does not match its head")
    meta = _verified_meta(view[start:], head[1], "trailer")
    assert meta is not None
    data = _unpack(meta)
    try:
        return BlobTrailer(int(data["total_bytes"]), int(data["chunk_count"]), int(data["payload_xxh64"]),
                           None if data["first_token"] is None else int(data["first_token"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise KVBadFormat(f"bad blob trailer: {exc!r}") from exc
