"""``DataPlane``: the connector's network side — one thread with its own event loop, never on vLLM's threads.

vLLM's CPU worker pins its OpenMP threads to cores, and a thread inherits the affinity of the thread that starts
it: an event loop started from the worker shares the worker's core and stalls behind the forward pass (a pull
then hangs until the next step). So the loop thread widens its own affinity to every CPU before it runs, and the
threads it starts (prfaas's verify pool) inherit that.

What runs on the loop: the producer's ``BlobWriter`` (codec, chunking, xxHash64) and either the store it writes into
(direct mode: a ``BlobStore`` served by a ``TransferServer``, the consumer pulls from it) or a ``push`` into the
relay's store (relay mode); the consumer's ``pull`` (striped, resuming, retried, deadline) and ``release``.
Everything the worker hands over is plain numpy (no torch here). Calls from the worker thread return at once:
producer calls are queued in order (``call_soon_threadsafe``), consumer calls return a
``concurrent.futures.Future``. A producer's failure aborts its blob and is logged: the consumer then finds no
blob (``KV_NOT_FOUND``) or a cut one (``KV_TRUNCATED``) and vLLM recomputes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from prfaas.errors import KVNotFound, KVTimeout, KVUnavailable, PrfaasError
from prfaas.kv.format import BlobHeader, BlobReader, BlobWriter
from prfaas.kv.state import KVState, LayerState
from prfaas.security import tls as tls_contexts
from prfaas.store.memory import BlobStore
from prfaas.transfer import client
from prfaas.transfer.server import TransferServer
from prfaas.vllm.settings import ConnectorSettings, split_address

log = logging.getLogger("vllm.prfaas")  # under vLLM's logger: its handlers and format
START_S = 10.0  # the loop thread and the direct-mode server must be up within this
CLOSE_S = 5.0
SWEEP_S = 1.0
T = TypeVar("T")


def _log_retry(kv_id: str, reader: BlobReader, attempt: int, exc: PrfaasError) -> None:
    log.warning("pull of %s: %s (%s) at chunk %d; retry %d", kv_id, exc.code, exc, reader.next_chunk, attempt)


def unpin_current_thread() -> None:
    """Let the calling thread run on every CPU of the machine (only this thread: Linux affinity is per thread)."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


class _Outgoing:
    """One blob being written, on the loop: frames go to the local store, or into the push to the relay."""

    def __init__(self, plane: DataPlane, header: BlobHeader, relay: str | None) -> None:
        self.plane, self.kv_id, self.relay = plane, header.kv_id, relay
        self.writer = BlobWriter(header)
        self.failed = False
        self.queue: asyncio.Queue[bytes | None] | None = None
        self.push: asyncio.Task[None] | None = None
        first = self.writer.header_frame()
        if relay is None and plane.store is not None:
            self._guard(plane.store.create, self.kv_id, first, plane.settings.kv_ttl_s)
        elif relay is None:
            self._fail(KVUnavailable("this producer has no store of its own (no kv_address)"))
        else:
            self.queue = asyncio.Queue()
            self.queue.put_nowait(first)
            self.push = plane.spawn(self._push())

    def add(self, layer: LayerState) -> None:
        if not self.failed:
            self._send(self._guard(self.writer.add_layer, layer) or [])

    def finish(self) -> None:
        if not self.failed:
            self._send(self._guard(self.writer.finish, None) or [])
        if self.queue is not None:
            self.queue.put_nowait(None)

    def _send(self, frames: list[bytes]) -> None:
        for frame in frames:
            if self.failed:
                return
            if self.queue is not None:
                self.queue.put_nowait(frame)
            elif frame[:1] == b"T":
                self._guard(self.plane.store.finish, self.kv_id, frame)  # type: ignore[union-attr]
            else:
                self._guard(self.plane.store.append, self.kv_id, frame)  # type: ignore[union-attr]

    def _guard(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except PrfaasError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug must not leave the blob half-written nor kill the loop's callback
            self._fail(PrfaasError(f"{type(exc).__name__}: {exc}"))
        return None

    def _fail(self, exc: PrfaasError) -> None:
        log.warning("blob %s not written (%s: %s); the consumer will recompute", self.kv_id, exc.code, exc)
        self.failed = True
        if self.push is not None:
            self.push.cancel()  # the relay sees the connection close and aborts the blob
        elif self.plane.store is not None:
            with contextlib.suppress(PrfaasError):
                self.plane.store.abort(self.kv_id)

    async def _frames(self) -> AsyncIterator[bytes]:
        assert self.queue is not None
        while (frame := await self.queue.get()) is not None:
            yield frame

    async def _push(self) -> None:
        settings = self.plane.settings
        try:
            await client.push(self.relay or "", self.kv_id, self._frames(), ssl=self.plane.client_ssl,
                              timeout_s=settings.kv_transfer_timeout_s, deadline_s=settings.kv_deadline_s)
            # no ttl_s: the relay keeps it for its own TTL, which is the relay operator's to set
        except asyncio.CancelledError:
            pass  # _fail: already logged
        except PrfaasError as exc:
            self.failed = True
            log.warning("push of %s to the relay failed (%s: %s); the consumer will recompute", self.kv_id,
                        exc.code, exc)


class DataPlane:
    """The loop thread. ``serve`` (direct mode) opens the producer's store and server; ``close`` ends them (blobs
    left end as ``shutdown``) and the thread. Owns every socket, task and blob it made."""

    def __init__(self, settings: ConnectorSettings, name: str = "prfaas-kv") -> None:
        self.settings = settings
        self.client_ssl = tls_contexts.client_context(settings.tls) if tls_contexts.enabled(settings.tls) else None
        self.store: BlobStore | None = None
        self.server: TransferServer | None = None
        self._outgoing: dict[str, _Outgoing] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # the loop keeps only weak references to tasks
        self._sweeper: asyncio.Task[None] | None = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(START_S):
            raise KVUnavailable("the connector's data-plane thread did not start")

    def _run(self) -> None:
        unpin_current_thread()
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A task on the loop (from the loop thread), kept until it ends; ``close`` waits for it."""
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- direct mode ---------------------------------------------------------------------------------------------

    def serve(self, address: str) -> int:
        """Open this producer's store and its data-plane server on ``address``; returns the bound port."""
        host, port = split_address(address)
        return self.call(self._serve(host, port)).result(START_S)

    async def _serve(self, host: str, port: int) -> int:
        settings = self.settings
        self.store = BlobStore(settings.store_budget_mb << 20, settings.kv_ttl_s, owner="vllm-producer")
        ssl = tls_contexts.server_context(settings.tls) if tls_contexts.enabled(settings.tls) else None
        self.server = TransferServer(self.store, host, port, ssl=ssl)
        bound = await self.server.start()
        self._sweeper = self.spawn(self._sweep())
        return bound

    async def _sweep(self) -> None:
        while self.store is not None:
            self.store.sweep()
            await asyncio.sleep(SWEEP_S)

    def stats(self) -> dict[str, Any]:
        """The local store's ``StoreStats`` (direct mode), for leak checks."""
        assert self.store is not None
        return self.store.stats().to_dict()

    # -- producer: ordered hand-offs from the worker thread ------------------------------------------------------

    def begin(self, header: BlobHeader, relay: str | None = None) -> None:
        """Start blob ``header.kv_id``: pushed to ``relay``, or (None) kept in this producer's store."""
        self._loop.call_soon_threadsafe(self._begin, header, relay)

    def add_layer(self, kv_id: str, layer: LayerState) -> None:
        self._loop.call_soon_threadsafe(self._add, kv_id, layer)

    def finish(self, kv_id: str) -> None:
        self._loop.call_soon_threadsafe(self._finish, kv_id)

    def _begin(self, header: BlobHeader, relay: str | None) -> None:
        self._outgoing[header.kv_id] = _Outgoing(self, header, relay)

    def _add(self, kv_id: str, layer: LayerState) -> None:
        if (out := self._outgoing.get(kv_id)) is not None:
            out.add(layer)

    def _finish(self, kv_id: str) -> None:
        if (out := self._outgoing.pop(kv_id, None)) is not None:
            out.finish()

    # -- consumer -----------------------------------------------------------------------------------------------

    def pull(self, address: str, kv_id: str) -> concurrent.futures.Future[KVState]:
        """Start pulling ``kv_id`` from the store at ``address``; the future fails with the prfaas error."""
        return self.call(self._pull(address, kv_id))

    async def _pull(self, address: str, kv_id: str) -> KVState:
        settings = self.settings
        started = time.monotonic()
        grace = started + settings.creation_grace_s
        try:
            async with asyncio.timeout(settings.kv_deadline_s):
                while True:
                    try:
                        reader = BlobReader()
                        state = await client.pull(address, kv_id, reader, retries=settings.retries,
                                                  timeout_s=settings.kv_transfer_timeout_s, ssl=self.client_ssl,
                                                  on_retry=functools.partial(_log_retry, kv_id, reader))
                        log.info("pulled %s from %s: %d bytes in %.1f ms", kv_id, address, state.nbytes,
                                 (time.monotonic() - started) * 1e3)
                        return state
                    except KVNotFound:
                        if time.monotonic() > grace:
                            raise
                        await asyncio.sleep(0.01)  # the producer may not have created it yet
        except TimeoutError as exc:
            raise KVTimeout(f"pull of {kv_id} passed its {settings.kv_deadline_s} s deadline") from exc

    def release(self, address: str, kv_id: str) -> concurrent.futures.Future[dict[str, Any]]:
        return self.call(client.release(address, kv_id, ssl=self.client_ssl,
                                        timeout_s=self.settings.kv_transfer_timeout_s))

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self.call(self._close()).result(CLOSE_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_S)

    async def _close(self) -> None:
        for out in self._outgoing.values():
            out.finish()
        self._outgoing.clear()
        pushes = [t for t in self._tasks if t is not self._sweeper]
        if pushes:  # let pushes under way end with their trailer (or their deadline)
            await asyncio.wait(pushes, timeout=CLOSE_S)
        if self.server is not None:
            await self.server.close()
        if self.store is not None:
            store, self.store = self.store, None  # ends the sweep task
            store.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
