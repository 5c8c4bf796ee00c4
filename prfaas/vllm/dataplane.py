"""``DataPlane``: the connector's network side — one thread with its own event loop, never on vLLM's threads.

vLLM's CPU worker pins its OpenMP threads to cores, and a thread inherits the affinity of the thread that starts
it: an event loop started from the worker shares the worker's core and stalls behind the forward pass (a pull
then hangs until the next step). So the loop thread widens its own affinity to every CPU before it runs, and the
threads it starts (prfaas's verify pool) inherit that.

What runs where. The worker thread (vLLM's) only queues: each saved layer (plain numpy, no torch here) goes to
the encoder thread, which runs the producer's ``BlobWriter`` (codec, chunking, xxHash64) and hands the frames to
the blob's sink (``prfaas.services.sinks``, as prfaas's own prefill does): direct mode, a ``BlobStore`` served by
a ``TransferServer`` (the consumer pulls from it); relay mode, a bounded push into the relay's store. A layer goes
at once, while later layers compute, or is held until the step's ``finish`` (for at most half a pull's stall
timeout) where the encoder would take cores and the GIL from the forward pass (vLLM on CPU: the connector's
``overlap``). The loop thread: the store, the pushes, the consumer's ``pull`` (striped, resuming, retried,
deadline) and ``release``.

Memory is bounded: a push holds at most ``PUSH_QUEUE_BYTES`` the relay has not taken; beyond that the encoder
waits (for at most ``kv_transfer_timeout_s``, then the push is refused and the rest of its blob dropped), and
the worker waits once it is ``ENCODE_QUEUE`` layers ahead of the encoder — back-pressure onto the forward pass,
as on prfaas's engine; held layers are the copies of one step's saved blocks. Consumer calls return a
``concurrent.futures.Future``. A producer's failure aborts its blob and is logged: the consumer then finds no blob
(``KV_NOT_FOUND``) or a cut one (``KV_TRUNCATED``) and vLLM recomputes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from prfaas import tls as tls_contexts
from prfaas.errors import KVNotFound, KVTimeout, KVUnavailable, PrfaasError
from prfaas.kv.format import BlobHeader, BlobReader, BlobWriter, Frame
from prfaas.kv.frames import FRAME_POOL_BYTES, FramePool
from prfaas.kv.state import KVState, LayerState
from prfaas.limits import DEFAULT as DEFAULT_LIMITS
from prfaas.messages import MAX_TCP_PEERS
from prfaas.security.dataplane import DataPlaneGuard
from prfaas.services.sinks import FrameSink, PushSink, StoreSink
from prfaas.store.memory import BlobStore
from prfaas.transfer import TransferContext, client
from prfaas.transfer.server import TransferServer
from prfaas.vllm.settings import ConnectorSettings, split_address

log = logging.getLogger("vllm.prfaas")  # under vLLM's logger: its handlers and format
ENCODE_QUEUE = 4  # layers (copies of their blocks) the worker may be ahead of the encoder thread
START_S = 10.0  # the loop thread and the direct-mode server must be up within this
CLOSE_S = 5.0
SWEEP_S = 1.0
T = TypeVar("T")
Held = tuple[LayerState, Callable[[], None] | None]  # a saved layer and what to call before reading its bytes


def _log_retry(kv_id: str, reader: BlobReader, attempt: int, exc: PrfaasError) -> None:
    log.warning("pull of %s: %s (%s) at chunk %d; retry %d", kv_id, exc.code, exc, reader.next_chunk, attempt)


def unpin_current_thread() -> None:
    """Let the calling thread run on every CPU of the machine (only this thread: Linux affinity is per thread)."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


class _Outgoing:
    """One blob being written. The encoder thread encodes each layer (``BlobWriter``: codec, chunking, xxHash64)
    and hands its frames to the blob's sink — this producer's store (``StoreSink``, direct mode) or the push to
    the relay (``PushSink``, relay mode), which holds at most ``PUSH_QUEUE_BYTES`` the relay has not taken yet:
    beyond that the encoder waits for at most ``kv_transfer_timeout_s``, then the push is refused and the rest of
    the blob dropped. The writer is the encoder thread's from ``begin`` to ``finish``; the sink's network side is
    the loop's."""

    def __init__(self, plane: DataPlane, kv_id: str, writer: BlobWriter, sink: FrameSink) -> None:
        self.plane, self.kv_id, self.writer = plane, kv_id, writer
        self.sink: FrameSink | None = sink  # None once the blob failed: the rest of it is dropped

    def add(self, layer: LayerState, ready: Callable[[], None] | None = None) -> None:
        """Encoder thread: encode ``layer`` and hand its frames over (may wait while a push is full); ``ready``
        first, where the layer's bytes are still on their way to host memory (a GPU's queued copy)."""
        if self.sink is not None:
            self._guard(lambda sink: sink.hand_over(self.writer.add_layer(_ready(layer, ready))), self.sink)

    def close(self) -> None:
        """Encoder thread: the trailer; the sink's outcome is awaited on the loop (``_finish``)."""
        if self.sink is not None:
            self._guard(lambda sink: self.plane.on_loop(self._finish(sink, self.writer.finish(None))), self.sink)

    def _guard(self, step: Callable[[FrameSink], None], sink: FrameSink) -> None:
        try:
            step(sink)
        except Exception as exc:  # a bug must stop this blob, never vLLM's forward pass
            self.sink = None
            _not_written(self.kv_id, exc)
            self.plane.on_loop(_abort(sink))

    async def _finish(self, sink: FrameSink, frames: list[Frame]) -> None:
        try:
            await sink.finish(frames)
        except Exception as exc:  # refused push, store full, relay gone: the consumer recomputes
            _not_written(self.kv_id, exc)
            await _abort(sink)
        finally:
            self.plane.report_tcp()


def _ready(layer: LayerState, ready: Callable[[], None] | None) -> LayerState:
    if ready is not None:
        ready()
    return layer


async def _abort(sink: FrameSink) -> None:
    with contextlib.suppress(PrfaasError):
        await sink.abort("aborted")  # a push is cancelled: the relay sees the connection cut and aborts the blob


def _not_written(kv_id: str, exc: BaseException) -> None:
    code = exc.code if isinstance(exc, PrfaasError) else type(exc).__name__
    log.warning("blob %s not written (%s: %s); the consumer will recompute", kv_id, code, exc)


class DataPlane:
    """The loop and encoder threads. ``serve`` (direct mode) opens the producer's store and server; ``close`` ends
    them (blobs left end as ``shutdown``) and the threads. Owns every socket, task and blob it made."""

    def __init__(self, settings: ConnectorSettings, name: str = "prfaas-kv") -> None:
        self.settings = settings
        self.client_ssl = tls_contexts.client_context(settings.tls) if tls_contexts.enabled(settings.tls) else None
        # what this connector's pulls share (arenas, verify threads, retry cap); its pulls are not bounded in number
        self.transfer = TransferContext.for_role(DEFAULT_LIMITS, self.client_ssl, max_inflight_kv=0)
        self.frames = FramePool(FRAME_POOL_BYTES)  # pushes' chunk frames, reused once sent (prfaas.kv.frames)
        self.store: BlobStore | None = None
        self.server: TransferServer | None = None
        self._outgoing: dict[str, _Outgoing] = {}  # the encoder thread's
        # the worker thread's: when each blob was begun, and the layers it holds back (``add_layer``'s ``hold``)
        self._begun_at: dict[str, float] = {}
        self._held: dict[str, list[Held]] = {}
        self._encoding: queue.Queue[Callable[[], None] | None] = queue.Queue(ENCODE_QUEUE)
        self._encoder = threading.Thread(target=self._encode, name=f"{name}-encode", daemon=True)
        self._tasks: set[asyncio.Task[Any]] = set()  # the loop keeps only weak references to tasks
        self._sweeper: asyncio.Task[None] | None = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._encoder.start()
        if not self._ready.wait(START_S):
            raise KVUnavailable("the connector's data-plane thread did not start")

    def _run(self) -> None:
        unpin_current_thread()
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()

    def _encode(self) -> None:
        unpin_current_thread()  # off the worker's pinned core, like the loop
        while (job := self._encoding.get()) is not None:
            job()  # each step guards itself: a failure ends its blob, never this thread

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
        if tls_contexts.enabled(settings.tls):  # each request authorised by the peer certificate's role, as on
            guard = DataPlaneGuard(settings.tls.required)  # prfaas's own prefill (decode reads, router releases)
            self.server = TransferServer(self.store, host, port, ssl=tls_contexts.server_context(settings.tls),
                                         authorize=guard, on_tls_refused=guard.tls_refused)
        else:
            self.server = TransferServer(self.store, host, port)
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

    # -- producer: calls from the worker thread, queued in order for the encoder ----------------------------------

    def begin(self, header: BlobHeader, relay: str | None = None) -> None:
        """Start blob ``header.kv_id``: pushed to ``relay``, or (None) kept in this producer's store. Like
        ``add_layer`` and ``finish``, returns once queued: the worker waits only while the encoder is
        ``ENCODE_QUEUE`` steps behind (a full push)."""
        self._begun_at[header.kv_id] = time.monotonic()
        self._encoding.put(functools.partial(self._begin, header, relay))

    def add_layer(self, kv_id: str, layer: LayerState, hold: bool = False,
                  ready: Callable[[], None] | None = None) -> None:
        """Queue ``layer`` for the encoder, which calls ``ready`` before it reads the layer's bytes (a GPU's copy
        into host memory, queued behind the forward pass: ``layout.gather``). ``hold``: keep it until ``finish``
        instead, while the blob is younger than half of ``kv_transfer_timeout_s`` — a consumer's pull, waiting on
        the begun blob, takes a longer silence for a stall — and from then on queue the held layers and each next
        one at once."""
        held = self._held.setdefault(kv_id, [])
        if hold and time.monotonic() - self._begun_at.get(kv_id, 0.0) < self.settings.kv_transfer_timeout_s / 2:
            held.append((layer, ready))
            return
        for each in [*held, (layer, ready)]:
            self._encoding.put(functools.partial(self._add, kv_id, each))
        held.clear()

    def finish(self, kv_id: str) -> None:
        """Encode the layers held for ``kv_id``, then write the trailer (the push, or the store, completes on the
        loop); one step of the encoder's queue."""
        self._begun_at.pop(kv_id, None)
        self._encoding.put(functools.partial(self._finish, kv_id, self._held.pop(kv_id, [])))

    def _begin(self, header: BlobHeader, relay: str | None) -> None:
        """Encoder thread: open the blob's sink on the loop (bounded); a blob that cannot start is logged and
        skipped (consumer: ``KV_NOT_FOUND``, recompute)."""
        writer = BlobWriter(header, pool=self.frames if relay else None)  # a store keeps its own copy
        opening = self.call(self._open(header.kv_id, writer.header_frame(), relay))
        try:
            sink = opening.result(START_S)
        except Exception as exc:  # store full, no store, a loop stuck past START_S
            opening.cancel()
            _not_written(header.kv_id, exc)
            return
        self._outgoing[header.kv_id] = _Outgoing(self, header.kv_id, writer, sink)

    def _add(self, kv_id: str, held: Held) -> None:
        if (out := self._outgoing.get(kv_id)) is not None:
            out.add(*held)

    def _finish(self, kv_id: str, held: list[Held]) -> None:
        if (out := self._outgoing.pop(kv_id, None)) is not None:
            for each in held:
                out.add(*each)
            out.close()

    def pushing_bytes(self) -> int:
        """Bytes of the blobs being written that their pushes have not sent yet (at most ``PUSH_QUEUE_BYTES`` plus
        one frame per blob)."""
        return sum(out.sink.queued_bytes for out in list(self._outgoing.values()) if isinstance(out.sink, PushSink))

    def on_loop(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a task on the loop (from any thread); ``close`` waits for it."""
        self._loop.call_soon_threadsafe(self.spawn, coro)

    async def _open(self, kv_id: str, header: bytes, relay: str | None) -> FrameSink:
        settings = self.settings
        if relay is not None:
            return PushSink(relay, kv_id, header, settings.kv_transfer_timeout_s, tls=self.client_ssl,
                            deadline_s=settings.kv_deadline_s, context=self.transfer)
        if self.store is None:
            raise KVUnavailable("this producer has no store of its own (no kv_address)")
        return StoreSink(self.store, kv_id, header, ttl_s=settings.kv_ttl_s)

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
                        reader = BlobReader(limits=self.transfer.limits)
                        state = await client.pull(address, kv_id, reader, retries=settings.retries,
                                                  timeout_s=settings.kv_transfer_timeout_s, context=self.transfer,
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
        finally:
            self.report_tcp()

    def report_tcp(self) -> None:
        """Loop thread: write this connector's ``TCP_INFO`` per peer (its pushes', then its pulls') into
        ``tcp_file``. The connector runs in vLLM's process; its prfaas instance, in another, reads the file for its
        heartbeat (``prfaas.vllm.server``). Written beside and renamed over, so a reader never sees half of it."""
        path = self.settings.tcp_file
        if not path:
            return
        stats = self.transfer.stats
        peers = [peer.to_json() for peer in (stats.push.peers() + stats.pull.peers())[-MAX_TCP_PEERS:]]
        try:
            with open(f"{path}.tmp", "w") as f:
                json.dump(peers, f)
            os.replace(f"{path}.tmp", path)
        except OSError as exc:  # the figures are advisory: a full disk must not fail a pull
            log.warning("cannot write the connector's TCP figures to %s: %s", path, exc)

    def release(self, address: str, kv_id: str) -> concurrent.futures.Future[dict[str, Any]]:
        return self.call(client.release(address, kv_id, ssl=self.client_ssl,
                                        timeout_s=self.settings.kv_transfer_timeout_s))

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(queue.Full):  # the encoder ends after what was queued before
            self._encoding.put(None, timeout=CLOSE_S)
        self._encoder.join(CLOSE_S)
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self.call(self._close()).result(CLOSE_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_S)
        self.transfer.close()

    async def _close(self) -> None:
        unfinished = [out.sink for out in self._outgoing.values() if out.sink is not None]
        self._outgoing.clear()
        for sink in unfinished:  # the forward pass that was saving them will not finish them: nobody wants them
            await _abort(sink)
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
