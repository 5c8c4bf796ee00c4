"""The KV data-plane wire protocol (TCP, optionally TLS 1.3). One request per exchange; a connection may carry
several exchanges in turn.

Every unit on the wire is a *frame* whose first byte says what it is::

    "M" u32 n u32 xxh32(body)  body          a control message: msgpack [PROTOCOL_VERSION, tag, {field: value}]
    "P" ...                                   a blob header frame   } exactly as ``prfaas.kv.format`` writes
    "C" u32 index u32 length u64 xxh64 u32 h  a blob chunk frame    } them: the blob travels in its own frames,
    "T" ...                                   a blob trailer frame  } never re-framed or concatenated

Exchanges (client → server, then server → client)::

    Put(kv_id, wait_ms, tenant, ttl_ms, ack_created)  P C* T  →  [Ok] Ok | Error  push a blob into the store
    Get(kv_id, from_chunk, wait_ms, stride, offset) →  Ok P C* T | Error  read a blob (resume: from_chunk > 0)
    Release(kv_id)                                 →  DeletionRecord | Error
    Stat()                                         →  StoreStats | Error

``Error(code, message)`` carries a code of ``prfaas.errors`` and is rebuilt with ``error_from_code``; it may
also arrive in the middle of a Get's frames (the blob expired, was aborted, or its writer stalled), after which
the server closes the connection. A resumed Get re-sends the header frame (the reader checks it is the same
blob) and then the chunks from ``from_chunk``. A striped Get (``stride`` N > 1, one per connection) sends only the
chunks ``i >= from_chunk`` with ``(i - from_chunk) % N == offset``, then the trailer: N connections share one blob.
Fields with defaults (``stride``, ``offset``) may be left out by older peers.
A Put with ``ack_created`` gets an extra ``Ok`` as soon as the blob exists in the store (readers may Get it from
then on), before the final ``Ok`` once the trailer is in: the pusher can tell its readers the blob is there.
``wait_ms`` is how long the server waits for the next chunk that
is still being written (Get) or for the next frame from the pusher (Put) before answering ``KV_TIMEOUT``.

Every length read from the wire is bounded before anything is allocated, by the wire limits the caller passes
(``prfaas.limits.WireLimits``: the role's ``config.limits``, the defaults when none are given): control messages by
``max_message_bytes``, header/trailer metadata by ``max_meta_bytes``, chunks by the blob's own chunk size (itself at
most ``max_chunk_bytes``). Memory follows the bytes that arrived, not the lengths claimed: a request is read as a
control frame only (any other tag is refused before its head is read), and a chunk over ``LAZY_FROM`` is received into
memory committed as its payload arrives.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack
import xxhash

from prfaas.errors import KVBadFormat, KVCorrupt, PrfaasError, error_from_code
from prfaas.kv.format import (
    CHUNK_HEAD_SIZE,
    HEADER_HEAD_SIZE,
    META_SUM_SIZE,
    TRAILER_HEAD_SIZE,
    meta_length,
    parse_chunk_head,
)
from prfaas.kv.frames import FramePool
from prfaas.limits import DEFAULT as DEFAULT_LIMITS
from prfaas.limits import WireLimits
from prfaas.records import DeletionRecord, StoreStats
from prfaas.transfer.wire import Conn

PROTOCOL_VERSION = 1
_MSG_HEAD = struct.Struct(">cII")
LAZY_FROM = 1 << 20  # a larger chunk is received into memory committed as its bytes arrive (``_read_chunk``)


@dataclass(frozen=True)
class Put:
    kv_id: str
    wait_ms: int
    tenant: str = ""  # whose blob (its records carry it); "" = none
    ttl_ms: int = 0  # the blob's own TTL (a tenant's override); 0 = the store's
    ack_created: bool = False  # answer Ok once the blob is created, then Ok again once it is whole


@dataclass(frozen=True)
class Get:
    kv_id: str
    from_chunk: int
    wait_ms: int
    stride: int = 1
    offset: int = 0

    def wants(self, index: int) -> bool:
        """Whether chunk ``index`` travels on this (possibly striped) Get."""
        return index >= self.from_chunk and (index - self.from_chunk) % self.stride == self.offset


@dataclass(frozen=True)
class Release:
    kv_id: str


@dataclass(frozen=True)
class Stat:
    pass


@dataclass(frozen=True)
class Ok:
    pass


@dataclass(frozen=True)
class Error:
    code: str
    message: str

    @classmethod
    def of(cls, exc: PrfaasError) -> Error:
        return cls(exc.code, exc.message[:4096])

    def exception(self) -> PrfaasError:
        return error_from_code(self.code, self.message)


Message = Put | Get | Release | Stat | Ok | Error | DeletionRecord | StoreStats
_TAGS: dict[str, type[Any]] = {
    "put": Put, "get": Get, "release": Release, "stat": Stat, "ok": Ok, "error": Error,
    "released": DeletionRecord, "stats": StoreStats,
}
_TAG_OF = {cls: tag for tag, cls in _TAGS.items()}
_FIELD_TYPES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "int | None": (int, type(None)),
                                             "bool": (bool,)}


def encode(message: Message) -> bytes:
    """One control frame (``"M"`` head + msgpack body) for ``message``."""
    values = asdict(message)
    if isinstance(message, Put) and not message.ack_created:
        del values["ack_created"]  # older servers refuse unknown fields: only a Put that asks for the ack has it
    body = msgpack.packb([PROTOCOL_VERSION, _TAG_OF[type(message)], values], use_bin_type=True)
    return _MSG_HEAD.pack(b"M", len(body), xxhash.xxh32_intdigest(body)) + body


def decode(body: bytes, limits: WireLimits = DEFAULT_LIMITS) -> Message:
    """The message in a control frame's body, every field type-checked (a Get's stride against ``limits``).
    ``KVBadFormat`` if it is not one."""
    try:
        version, tag, values = msgpack.unpackb(body, raw=False)
    except Exception as exc:
        raise KVBadFormat(f"undecodable control message: {exc}") from exc
    cls = _TAGS.get(tag) if isinstance(tag, str) else None
    if version != PROTOCOL_VERSION or cls is None or not isinstance(values, dict):
        raise KVBadFormat(f"unknown control message (version {version!r}, tag {str(tag)[:40]!r})")
    spec = {f.name: _FIELD_TYPES[str(f.type)] for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is dataclasses.MISSING}
    if not required <= set(values) <= set(spec) or not all(isinstance(values[k], spec[k]) for k in values):
        raise KVBadFormat(f"control message {tag!r} has wrong fields: {sorted(values)[:10]}")
    message: Message = cls(**values)
    if isinstance(message, Get) and not 0 <= message.offset < message.stride <= limits.max_stride:
        raise KVBadFormat(f"Get stride {message.stride} / offset {message.offset} out of limits")
    return message


Buffer = Callable[[int], memoryview]


@dataclass(frozen=True)
class Frame:
    """One frame read off the wire. For a chunk, ``head`` is its ``CHUNK_HEAD_SIZE`` bytes and ``data`` the
    payload (its xxHash64 not yet checked: the consumer checks it before use); ``frame`` is the whole frame when
    it lies in one buffer. For a header or trailer, ``frame`` is the whole frame; for a control frame, ``message``
    is set."""

    tag: bytes
    head: bytes = b""
    data: bytes | bytearray | memoryview = b""
    index: int = 0
    checksum: int = 0
    message: Message | None = None
    frame: bytes | bytearray | memoryview | None = None

    @property
    def whole(self) -> bytes | bytearray | memoryview:
        return self.frame if self.frame is not None else self.head + bytes(self.data)


async def read_frame(conn: Conn, max_chunk: int | None = None, buffer: Buffer | None = None,
                     limits: WireLimits = DEFAULT_LIMITS, pool: FramePool | None = None) -> Frame:
    """Read exactly one frame from ``conn``. A chunk's data goes into ``buffer(length)`` when given (the caller's
    preallocated memory), else into a buffer that also holds the head (``frame``): for a full chunk (``max_chunk``
    bytes) ``pool``'s when it has one free, else a fresh one. ``KVCorrupt`` for a damaged head or an unknown tag,
    ``KVBadFormat`` for a length over its limit, ``asyncio.IncompleteReadError`` if the peer closes mid-frame.
    ``max_chunk`` defaults to ``limits.max_chunk_bytes``."""
    tag = bytes(await conn.read_exactly(1))
    if tag == b"C":
        head = tag + bytes(await conn.read_exactly(CHUNK_HEAD_SIZE - 1))
        index, length, checksum = parse_chunk_head(head, limits)
        max_chunk = limits.max_chunk_bytes if max_chunk is None else max_chunk
        if length > max_chunk:
            raise KVBadFormat(f"chunk {index} claims {length} bytes, over the blob's chunk size {max_chunk}")
        if buffer is not None:
            data = buffer(length)
            await conn.recv_exactly(data)
            return Frame(tag, head, data, index, checksum)
        whole = await _read_chunk(conn, head, length, pool if length == max_chunk else None)  # full chunks only
        return Frame(tag, head, memoryview(whole)[CHUNK_HEAD_SIZE:], index, checksum, frame=whole)
    if tag in (b"P", b"T"):
        head = tag + bytes(await conn.read_exactly((HEADER_HEAD_SIZE if tag == b"P" else TRAILER_HEAD_SIZE) - 1))
        rest = bytes(await conn.read_exactly(meta_length(head, limits) + META_SUM_SIZE))
        return Frame(tag, head, rest, frame=head + rest)
    if tag == b"M":
        return Frame(tag, message=await _read_message_body(conn, limits))
    raise KVCorrupt(f"damaged frame: unknown tag {tag!r}")


async def _read_chunk(conn: Conn, head: bytes, length: int, pool: FramePool | None) -> bytearray | memoryview:
    """A chunk frame (``head`` + ``length`` payload bytes) received in place into one buffer. Up to
    ``LAZY_FROM`` bytes (the default chunk size) that is a ``bytearray``: one of ``pool``'s that nothing holds any
    more (memory touched before, prfaas.kv.frames), else a new one. A larger chunk goes into anonymous memory that
    the kernel commits page by page as the payload is written into it: no zero-fill pass, no copy, and a peer that
    claims a large chunk and sends little holds only the pages it filled."""
    size = CHUNK_HEAD_SIZE + length
    whole: bytearray | memoryview | None = pool.take(size) if pool is not None and length <= LAZY_FROM else None
    if whole is None:
        whole = bytearray(size) if length <= LAZY_FROM else _lazy(size)
    memoryview(whole)[:CHUNK_HEAD_SIZE] = head
    await conn.recv_exactly(memoryview(whole)[CHUNK_HEAD_SIZE:])
    return whole


def _lazy(size: int) -> memoryview:
    """``size`` bytes of private anonymous memory, committed as it is first written (kept alive by its views)."""
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # no huge-page advice (buffers.new_arena)
    return memoryview(region)


async def _read_message_body(conn: Conn, limits: WireLimits) -> Message:
    _, n, checksum = _MSG_HEAD.unpack(b"M" + bytes(await conn.read_exactly(_MSG_HEAD.size - 1)))
    if n > limits.max_message_bytes:
        raise KVBadFormat(f"control message of {n} bytes is over the {limits.max_message_bytes}-byte limit")
    body = bytes(await conn.read_exactly(n))
    if xxhash.xxh32_intdigest(body) != checksum:
        raise KVCorrupt("control message failed its xxHash32 check")
    return decode(body, limits)


async def read_message(conn: Conn, limits: WireLimits = DEFAULT_LIMITS) -> Message:
    """Read one control frame; anything else is ``KVBadFormat``, refused at its tag byte: a server reads a
    request with this before it knows what the peer may do, so nothing a peer sends is buffered beyond
    ``max_message_bytes`` before its request is authorised. An ``Error`` is returned, not raised."""
    tag = bytes(await conn.read_exactly(1))
    if tag != b"M":
        raise KVBadFormat(f"expected a control message, got a {tag!r} frame")
    return await _read_message_body(conn, limits)


def expect(message: Message, cls: type[Any]) -> Any:
    """``message`` if it is a ``cls``; the peer's error raised if it is an ``Error``; else ``KVBadFormat``."""
    if isinstance(message, Error):
        raise message.exception()
    if not isinstance(message, cls):
        raise KVBadFormat(f"expected {cls.__name__}, got {type(message).__name__}")
    return message
