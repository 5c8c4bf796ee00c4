"""Wire limits from config (``limits:``): bad values refused when the config loads; an input over a configured
limit refused with its code before the claimed size is read or allocated, on the data plane, by the blob parser
and on the HTTP control plane."""

from __future__ import annotations

import asyncio
import struct
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import xxhash
from fastapi import FastAPI, Request

from prfaas.config import Config, load_config
from prfaas.errors import InvalidRequest, KVBadFormat, KVTooLarge
from prfaas.kv import BlobReader
from prfaas.limits import DEFAULT, WireLimits
from prfaas.security.bodylimit import BodyLimit
from prfaas.services import http
from prfaas.services.kvstore import StoreRuntime
from prfaas.store import BlobStore
from prfaas.transfer import TransferServer
from prfaas.transfer import protocol as p
from tests.transfer.helpers import blob_frames, make_state, run

CLAIM = 48 << 10  # under the default control-message limit (64 KiB), over the configured one


@pytest.mark.parametrize(("text", "words"), [
    ("limits: {max_message_bytes: 0}", "limits.max_message_bytes must be a positive integer"),
    ("limits: {max_layers: many}", "limits.max_layers must be a positive integer"),
    ("limits: {max_chunk_bytes: 2048}", "limits.max_chunk_bytes must be within"),
    ("limits: {max_blob_bytes: 65536}", "limits.max_blob_bytes must be"),
    ("limits: {max_frames: 3}", "max_frames"),
    ("{chunk_size_kb: 2048, limits: {max_chunk_bytes: 1048576}}", "chunk_size_kb must not exceed"),
])
def test_bad_limits_are_refused_at_load(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(InvalidRequest, match=words):
        load_config(path)


def test_limits_load_and_apply(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("limits: {max_message_bytes: 2048, max_layers: 3}")
    config = load_config(path)
    assert config.limits == WireLimits(max_message_bytes=2048, max_layers=3)
    assert Config().limits == WireLimits() == DEFAULT


async def _raw_exchange(address: tuple[str, int], data: bytes) -> p.Message:
    """Send ``data`` on a plain socket and read the server's one reply (a control message)."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(data)
        await writer.drain()
        _, n, _ = struct.unpack(">cII", await reader.readexactly(9))
        return p.decode(await reader.readexactly(n))
    finally:
        writer.close()
        await writer.wait_closed()


def test_data_plane_refuses_an_oversized_message_before_reading_it() -> None:
    """The head claims 48 KiB and the body is never sent: the server answers at once, so it neither waited for
    the body (it would have, until its idle timeout) nor allocated room for it."""
    head = struct.pack(">cII", b"M", CLAIM, xxhash.xxh32_intdigest(b""))

    async def scenario() -> tuple[p.Message, p.Message]:
        kv = StoreRuntime(Config(limits=WireLimits(max_message_bytes=1024)), "relay-l")
        server = kv.server("127.0.0.1", 0)
        port = await server.start()
        try:
            small = await _raw_exchange(("127.0.0.1", port), head)
            default = await _raw_exchange(("127.0.0.1", port), p.encode(p.Stat()))  # a message within the limit
        finally:
            await server.close()
            kv.close()
        return small, default

    refused, default = run(scenario)
    assert isinstance(refused, p.Error) and refused.code == KVBadFormat.code and "1024" in refused.message
    assert not isinstance(default, p.Error)


def test_data_plane_refuses_a_blob_over_the_chunk_limit() -> None:
    kv_id, frames = blob_frames(make_state(layers=1, tokens=16), chunk_size=64 << 10)

    async def scenario() -> p.Message:
        store = BlobStore(64 << 20, 60, limits=WireLimits(max_chunk_bytes=16 << 10))  # under any config's chunk
        server = TransferServer(store)
        port = await server.start()
        try:
            return await _raw_exchange(("127.0.0.1", port), p.encode(p.Put(kv_id, 1000)) + frames[0])
        finally:
            assert store.stats().blobs == 0
            await server.close()
            store.close()

    reply = run(scenario)
    assert isinstance(reply, p.Error) and reply.code == KVBadFormat.code


def test_blob_parser_limits() -> None:
    _, frames = blob_frames(make_state(layers=4, tokens=64), chunk_size=16 << 10)
    blob = b"".join(frames)
    with pytest.raises(KVBadFormat):
        BlobReader(limits=WireLimits(max_layers=2)).feed(blob)
    BlobReader(limits=WireLimits(max_blob_bytes=64 << 20, max_chunk_bytes=16 << 10)).feed(blob)  # within every limit
    tracemalloc.start()
    with pytest.raises(KVTooLarge):
        BlobReader(limits=WireLimits(max_blob_bytes=32 << 10, max_chunk_bytes=16 << 10)).feed(blob)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 * len(blob)  # the input and its staging copy; no layer buffer of the claimed size
    head = frames[0][:6] + struct.pack(">I", 8192)  # a header frame claiming 8 KiB of metadata, checksum intact
    with pytest.raises(KVBadFormat, match="4096"):
        BlobReader(limits=WireLimits(max_meta_bytes=4096)).feed(head + struct.pack(">I", xxhash.xxh32_intdigest(head)))


def body_app(seen: list[int], max_bytes: int) -> FastAPI:
    app = FastAPI()
    http.install_error_handlers(app)

    @app.post("/generate")
    async def generate(request: Request) -> dict[str, Any]:
        seen.append(len(await request.body()))
        return {"ok": True}

    app.add_middleware(BodyLimit, max_bytes=max_bytes)
    return app


def test_http_body_and_header_limits() -> None:
    seen: list[int] = []

    async def chunks(n: int) -> AsyncIterator[bytes]:
        for _ in range(n):
            yield b"x" * 1024

    async def scenario() -> list[tuple[int, str | None]]:
        sock = http.bind("127.0.0.1", 0)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/generate"
        task = asyncio.create_task(http.serve(body_app(seen, 4096), sock, limits=WireLimits(max_header_bytes=2048)))
        out = []
        try:
            async with httpx.AsyncClient(timeout=5.0) as c:
                for _ in range(100):
                    try:
                        await c.post(url, content=b"{}")
                        break
                    except httpx.HTTPError:
                        await asyncio.sleep(0.05)
                for content in (b"x" * 4096, b"x" * 4097, chunks(3), chunks(5)):
                    reply = await c.post(url, content=content)
                    out.append((reply.status_code, reply.json().get("error", {}).get("code")
                                if reply.status_code != 200 else None))
            # 8 KiB of a request head that never ends: under h11's default (16 KiB) the server would wait for
            # the rest; over the configured 2 KiB it answers 400 at once
            reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            writer.write(b"POST /generate HTTP/1.1\r\nhost: x\r\nx-padding: " + b"y" * 8192)
            await writer.drain()
            status = (await asyncio.wait_for(reader.readline(), 5)).split()[1]
            writer.close()
            await writer.wait_closed()
            out.append((int(status), None))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sock.close()
        return out

    results = asyncio.run(scenario())
    assert results == [(200, None), (413, KVTooLarge.code), (200, None), (413, KVTooLarge.code), (400, None)]
    assert seen == [2, 4096, 3072]  # the oversized bodies never reached the handler

