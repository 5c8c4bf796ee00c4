"""The router's ``Releaser``: a release the store could not answer (a relay stopped, its blob still there once it
runs again) is asked again in the background until the store answers, and ``close`` leaves no task behind. Real
sockets: a listener that never accepts stands in for the stopped relay, then a real store takes its port."""

from __future__ import annotations

import asyncio
import socket

from prfaas.store.memory import BlobStore
from prfaas.transfer.abandon import Releaser
from prfaas.transfer.server import TransferServer
from tests.transfer.helpers import blob_frames, fill, make_state, run


def _stopped_store() -> socket.socket:
    """A listener whose process does not run: connections complete in the kernel's backlog, nothing answers."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener


def test_a_release_the_store_could_not_answer_is_asked_again_once_it_runs() -> None:
    kv_id, frames = blob_frames(make_state())

    async def scenario() -> None:
        stopped = _stopped_store()
        port = stopped.getsockname()[1]
        address = f"127.0.0.1:{port}"
        releaser = Releaser(timeout_s=0.3, every_s=0.2, for_s=10)
        await releaser.release(address, kv_id)  # no answer: retried in the background
        assert releaser.retrying == 1
        stopped.close()
        store = BlobStore(64 << 20, 60)
        fill(store, kv_id, frames)  # the blob the stopped store held, there once it runs again
        server = TransferServer(store, "127.0.0.1", port)
        await server.start()
        try:
            for _ in range(100):
                if not releaser.retrying:
                    break
                await asyncio.sleep(0.05)
            assert releaser.retrying == 0 and store.stats().blobs == 0
            assert [r.reason for r in store.records] == ["released"]
        finally:
            await releaser.close()
            await server.close()

    run(scenario)


def test_close_ends_the_retries() -> None:
    async def scenario() -> None:
        stopped = _stopped_store()
        try:
            releaser = Releaser(timeout_s=0.2, every_s=0.1, for_s=30)
            await releaser.release(f"127.0.0.1:{stopped.getsockname()[1]}", "0" * 12 + "-" + "0" * 13 + "-" + "a" * 20)
            assert releaser.retrying == 1
            await releaser.close()
            assert releaser.retrying == 0
        finally:
            stopped.close()

    run(scenario)


def test_a_store_that_answers_is_asked_once() -> None:
    async def scenario() -> None:
        store = BlobStore(64 << 20, 60)
        server = TransferServer(store, "127.0.0.1", 0)
        address = f"127.0.0.1:{await server.start()}"
        try:
            releaser = Releaser()
            await releaser.release(address, "0" * 12 + "-" + "0" * 13 + "-" + "a" * 20)  # not there: KV_NOT_FOUND
            assert releaser.retrying == 0
        finally:
            await server.close()

    run(scenario)
