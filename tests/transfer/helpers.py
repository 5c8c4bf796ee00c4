"""Test helpers for the data plane: KV states made of numpy arrays, a leak-checking ``run``, and a fault-injecting
TCP proxy (cut, reset, byte flip, stall) for the server → client direction."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import ml_dtypes
import numpy as np

from prfaas.kv import BlobWriter, Fingerprint, KVState, LayerState
from prfaas.kv.format import state_frames
from prfaas.store import BlobStore

T = TypeVar("T")
FP = Fingerprint("m", "llama", "a" * 16, "b" * 16, "float32", 8192)


def make_state(layers: int = 6, tokens: int = 256, seed: int = 0) -> KVState:
    """Full-attention layers of float32 K/V plus one bf16 linear-attention state: a few MiB."""
    rng = np.random.default_rng(seed)
    out = [LayerState(i, "full_attention", True, None, {
        "keys": rng.standard_normal((1, 4, tokens, 64), dtype=np.float32),
        "values": rng.standard_normal((1, 4, tokens, 64), dtype=np.float32)}) for i in range(layers)]
    out.append(LayerState(layers, "linear_attention", False, None, {
        "recurrent_states.0": rng.standard_normal((1, 4, 32, 32)).astype(ml_dtypes.bfloat16)},
        {"has_previous_state": {0: True}}))
    return KVState(FP, tokens, out, first_token=42)


def blob_frames(state: KVState, chunk_size: int = 64 << 10) -> tuple[str, list[bytes]]:
    """``(kv_id, [header, chunk…, trailer])`` for ``state``."""
    writer = BlobWriter.for_state(state, chunk_size=chunk_size)
    return writer.header.kv_id, list(state_frames(writer, state))


def fill(store: BlobStore, kv_id: str, frames: list[bytes]) -> None:
    store.create(kv_id, frames[0])
    for frame in frames[1:-1]:
        store.append(kv_id, frame)
    store.finish(kv_id, frames[-1])


def assert_same(a: KVState, b: KVState) -> None:
    assert (a.fingerprint, a.seq_len, a.first_token, a.cache) == (b.fingerprint, b.seq_len, b.first_token, b.cache)
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert la.table_entry() == lb.table_entry() and la.attrs == lb.attrs
        assert la.tensors.keys() == lb.tensors.keys()
        for name in la.tensors:
            assert la.tensors[name].dtype == lb.tensors[name].dtype
            assert la.tensors[name].tobytes() == lb.tensors[name].tobytes()


def assert_clean(*stores: BlobStore) -> None:
    """No blob left, and every blob that ever lived ended in exactly one record."""
    for store in stores:
        assert store.stats().blobs == 0 and store.stats().bytes == 0
        assert len(store.records) == store.stats().deleted
        final = [r.kv_id for r in store.records if r.reason != "aborted"]  # an aborted id may be written again
        assert len(final) == len(set(final))


def _open_fds() -> dict[int, str]:
    """This process's descriptors and what each points to."""
    fds: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return fds


def _leaked(before: dict[int, str], settle_s: float = 2.0) -> dict[int, str]:
    """Descriptors opened since ``before`` that stay open for ``settle_s``: a descriptor another thread holds
    for a moment (a still-closing server of an earlier test, a /proc read) is not a leak; one that stays is."""
    deadline = time.monotonic() + settle_s
    while True:
        gc.collect()
        new = {fd: target for fd, target in _open_fds().items() if before.get(fd) != target}
        if not new or time.monotonic() >= deadline:
            return new
        time.sleep(0.05)


def run(factory: Callable[[], Awaitable[T]], timeout_s: float = 30.0) -> T:
    """Run a test coroutine in a fresh event loop; afterwards no task may be left and no file descriptor open."""
    gc.collect()
    before = _open_fds()

    async def main() -> T:
        async with asyncio.timeout(timeout_s):
            result = await factory()
        await asyncio.sleep(0.01)  # let transports finish closing
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not left, f"tasks left running: {left}"
        return result

    result = asyncio.run(main())
    leaked = _leaked(before)
    assert not leaked, f"sockets or files left open: {leaked}"
    return result


@dataclass(frozen=True)
class Fault:
    """What to do to one connection's server → client bytes (offsets count from the connection's start)."""

    cut_after: int | None = None  # close both sides after this many bytes (reset=True: with a TCP RST)
    reset: bool = False
    flip_at: int | None = None  # XOR one byte at this offset
    stall_after: int | None = None  # forward nothing more after this many bytes (until the client gives up)
    delay_s: float = 0.0  # wait this long before forwarding each piece (a slow, jittery path)


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_port``; ``plan(n)`` gives connection ``n``'s fault."""

    def __init__(self, upstream_port: int, plan: Callable[[int], Fault | None]) -> None:
        self.upstream_port, self.plan = upstream_port, plan
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        # a connection accepted just before the close has a handler task that may not have started yet
        handlers = {t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == "FaultProxy._handle"}
        for task in handlers | self._tasks:
            task.cancel()
        await asyncio.gather(*(handlers | self._tasks), return_exceptions=True)

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        fault = self.plan(self.connections)
        self.connections += 1
        try:
            ureader, uwriter = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except (OSError, asyncio.CancelledError):
            cwriter.close()
            self._tasks.discard(task)
            return
        pumps = [asyncio.create_task(_pump(creader, uwriter, None)),
                 asyncio.create_task(_pump(ureader, cwriter, fault))]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # proxy closing
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            if fault is not None and fault.reset:
                sock = cwriter.get_extra_info("socket")
                with contextlib.suppress(OSError):  # the client may have closed first: nothing left to reset
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            for writer in (cwriter, uwriter):
                writer.close()  # both before any wait: a cancelled wait must not leave the other open
            for writer in (cwriter, uwriter):
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await writer.wait_closed()
            self._tasks.discard(task)


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, fault: Fault | None) -> None:
    offset = 0
    with contextlib.suppress(OSError):
        while data := bytearray(await src.read(1 << 16)):
            if fault is not None and fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            if fault is not None and fault.flip_at is not None and offset <= fault.flip_at < offset + len(data):
                data[fault.flip_at - offset] ^= 0x40
            limit = None if fault is None else (fault.cut_after if fault.cut_after is not None else fault.stall_after)
            if limit is not None and offset + len(data) >= limit:
                dst.write(data[:limit - offset])
                await dst.drain()
                if fault is not None and fault.stall_after is not None:
                    await asyncio.Event().wait()  # until the proxy or the other direction ends this connection
                return
            dst.write(data)
            await dst.drain()
            offset += len(data)
