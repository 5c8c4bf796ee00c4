"""TLS connections that end badly: a peer that sends close_notify in the middle of a chunk, a reset or a cut
during a TLS read, a damaged record, a pusher that vanishes mid-chunk. Each maps to its error code (or heals by
resuming), and nothing is left open, running or stored."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
from collections.abc import Callable, Iterator

import pytest

from prfaas.errors import KVTruncated, PrfaasError
from prfaas.kv import BlobReader, KVState
from prfaas.store import BlobStore
from prfaas.transfer import TransferServer, pull, push
from prfaas.transfer import protocol as p
from prfaas.transfer.wire import Conn
from tests.transfer.helpers import Fault, FaultProxy, assert_clean, assert_same, blob_frames, fill, make_state, run
from tests.transfer.test_tls import contexts

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

STATE = make_state()
KV_ID, FRAMES = blob_frames(STATE)
MID_STREAM = 400_000  # bytes into a Get's TLS stream: well past the handshake, inside a chunk of the blob


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ssl.SSLContext, ssl.SSLContext]]:
    server, client, _ = contexts(tmp_path_factory.mktemp("tls"))
    yield server, client


def pull_through(tls: tuple[ssl.SSLContext, ssl.SSLContext], plan: Callable[[int], Fault | None], retries: int
                 ) -> tuple[KVState | PrfaasError, int]:
    """Pull ``KV_ID`` over TLS through a fault proxy; returns the state (or the error) and the connections made."""
    server_ctx, client_ctx = tls

    async def scenario() -> tuple[KVState | PrfaasError, int]:
        store = BlobStore(64 << 20, 120)
        fill(store, KV_ID, FRAMES)
        server = TransferServer(store, ssl=server_ctx)
        proxy = FaultProxy(await server.start(), plan)
        address = f"127.0.0.1:{await proxy.start()}"
        result: KVState | PrfaasError
        try:
            result = await pull(address, KV_ID, BlobReader(), ssl=client_ctx, timeout_s=2.0, retries=retries,
                                backoff_s=0.01)
        except PrfaasError as exc:
            result = exc
        await proxy.close()
        await server.close()
        assert store.stats().readers == 0
        store.release(KV_ID)
        assert_clean(store)
        return result, proxy.connections

    return run(scenario)


@pytest.mark.parametrize("fault", [Fault(cut_after=MID_STREAM), Fault(cut_after=MID_STREAM, reset=True),
                                   Fault(flip_at=MID_STREAM)], ids=["cut", "reset", "damaged-record"])
def test_a_broken_tls_stream_is_truncated_then_heals_by_resuming(tls: tuple[ssl.SSLContext, ssl.SSLContext],
                                                                  fault: Fault) -> None:
    result, connections = pull_through(tls, lambda n: fault, retries=0)
    assert isinstance(result, KVTruncated) and connections == 1
    result, connections = pull_through(tls, lambda n: fault if n == 0 else None, retries=1)
    assert isinstance(result, KVState) and connections == 2
    assert_same(STATE, result)


def test_close_notify_in_the_middle_of_a_chunk_is_truncation(tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    """A TLS peer that answers a Get with the header and half a chunk, then a clean TLS close (close_notify)."""
    server_ctx, client_ctx = tls
    served: list[bool] = []

    async def half_a_chunk(conn: Conn) -> None:
        try:
            await conn.start_tls(server_ctx, server_side=True)
            assert isinstance(await p.read_message(conn), p.Get)
            await conn.sendall(p.encode(p.Ok()), FRAMES[0], FRAMES[1][:len(FRAMES[1]) // 2])
            assert conn.tls is not None
            with contextlib.suppress(ssl.SSLWantReadError):
                conn.tls.unwrap()  # sends close_notify; the peer's own close_notify is not awaited
            served.append(True)
            scratch = memoryview(bytearray(1 << 16))
            async with asyncio.timeout(2.0):
                while await conn.drain(scratch):
                    pass
        finally:
            conn.close()

    async def scenario() -> None:
        tasks: set[asyncio.Task[None]] = set()

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket").dup()  # our own descriptor, so Conn owns and closes it
            writer.transport.abort()
            task = asyncio.create_task(half_a_chunk(Conn(sock)))
            tasks.add(task)

        listener = await asyncio.start_server(accept, "127.0.0.1", 0)
        address = f"127.0.0.1:{listener.sockets[0].getsockname()[1]}"
        with pytest.raises(KVTruncated):
            await pull(address, KV_ID, BlobReader(), ssl=client_ctx, timeout_s=2.0, retries=0)
        await asyncio.gather(*tasks)
        listener.close()
        await listener.wait_closed()

    run(scenario)
    assert served == [True]


def test_a_tls_pusher_that_vanishes_mid_chunk_leaves_nothing(tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    server_ctx, client_ctx = tls

    class Vanished(Exception):
        pass

    def frames() -> Iterator[bytes]:
        yield from FRAMES[:3]
        yield FRAMES[3][:len(FRAMES[3]) // 3]  # a third of a chunk frame, then the pusher is gone
        raise Vanished

    async def scenario() -> None:
        store = BlobStore(64 << 20, 120)
        server = TransferServer(store, ssl=server_ctx)
        address = f"127.0.0.1:{await server.start()}"
        with pytest.raises(Vanished):
            await push(address, KV_ID, frames(), ssl=client_ctx, timeout_s=2.0)
        for _ in range(200):  # the server sees the end of the stream and aborts the blob
            if store.stats().blobs == 0 and store.records:
                break
            await asyncio.sleep(0.01)
        assert [r.reason for r in store.records] == ["aborted"]
        await server.close()
        assert_clean(store)

    run(scenario)
