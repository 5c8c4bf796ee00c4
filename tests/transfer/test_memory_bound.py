"""A real relay process holds memory for the bytes a peer sent, not for the lengths it claimed.

The attack: a 21-byte chunk head claiming 64 MiB, on several connections, with no payload behind it. Before a
request (as the first frame of a connection) it must be refused at once; inside a Put the chunk's memory may only
be committed as its payload arrives (``protocol.LAZY_FROM``). Either way the relay's RSS must not grow by the
claimed sizes, and it must keep serving real blobs (one with chunks larger than ``LAZY_FROM``).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psutil
import pytest

from prfaas.errors import PrfaasError
from prfaas.kv import BlobReader
from prfaas.kv.format import _CHUNK, _sealed
from prfaas.transfer import protocol as p
from prfaas.transfer import pull, push, release, stat
from tests.services.deploy import free_port
from tests.transfer.helpers import assert_same, blob_frames, make_state

CLAIMED = 64 << 20
CONNECTIONS = 4
MiB = 1 << 20


@contextmanager
def store_process(role: str = "relay", config: str | None = None,
                  log: Path | None = None) -> Iterator[tuple[str, psutil.Process]]:
    """``prfaas serve relay`` (or ``prefill``, whose store serves direct mode) with ``config`` (a YAML path), its
    router unreachable (heartbeats fail quietly), its output in ``log`` if given; yields its data-plane address and
    process."""
    kv_port = free_port()
    model = ["--model", "tiny-llama"] if role == "prefill" else []
    cmd = [sys.executable, "-m", "prfaas", "serve", role, "--router", f"http://127.0.0.1:{free_port()}",
           "--kv-port", str(kv_port), *model, *(["--config", config] if config else [])]
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the relay exited"
            try:  # a Stat answered: the data-plane server itself (the port is bound before it, then handed over)
                asyncio.run(stat(f"127.0.0.1:{kv_port}", timeout_s=1.0))
                break
            except PrfaasError:
                assert time.monotonic() < deadline, "the relay did not start"
                time.sleep(0.1)
        yield f"127.0.0.1:{kv_port}", psutil.Process(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        if log:
            out.close()  # type: ignore[union-attr]


def forged_head() -> bytes:
    return _sealed(_CHUNK.pack(b"C", 0, CLAIMED, 0))


def attack(address: str, prefix: bytes, stack: ExitStack) -> list[socket.socket]:
    """``CONNECTIONS`` connections that each sent ``prefix`` and a forged chunk head, then nothing."""
    host, port = address.split(":")
    socks = []
    for _ in range(CONNECTIONS):
        sock = stack.enter_context(socket.create_connection((host, int(port)), timeout=5.0))
        sock.sendall(prefix + forged_head())
        socks.append(sock)
    time.sleep(1.0)  # the relay has read what we sent (and, before the fix, allocated what it claimed)
    return socks


def grown(proc: psutil.Process, before: int) -> int:
    return proc.memory_info().rss - before


@pytest.mark.parametrize("role", ["relay", "prefill"])
def test_a_forged_chunk_head_before_any_request_is_refused_without_allocating(role: str) -> None:
    with store_process(role) as (address, proc), ExitStack() as stack:
        before = proc.memory_info().rss
        socks = attack(address, b"", stack)
        assert grown(proc, before) < 16 * MiB
        for sock in socks:  # answered KV_BAD_FORMAT and closed, not held for the idle timeout
            reply = sock.recv(4096)
            assert b"KV_BAD_FORMAT" in reply
        healthy(address)


@pytest.mark.parametrize("sent_mib", [0, 3])
def test_a_forged_chunk_head_inside_a_put_holds_only_what_was_sent(sent_mib: int) -> None:
    with store_process() as (address, proc), ExitStack() as stack:
        before = proc.memory_info().rss
        prefixes = []
        for seed in range(CONNECTIONS):
            kv_id, frames = blob_frames(make_state(layers=1, tokens=16, seed=seed), chunk_size=CLAIMED)
            prefixes.append(p.encode(p.Put(kv_id, 30_000)) + frames[0])
        socks = [stack.enter_context(socket.create_connection(tuple_of(address), timeout=5.0)) for _ in prefixes]
        for sock, prefix in zip(socks, prefixes, strict=True):
            sock.sendall(prefix + forged_head() + b"x" * (sent_mib * MiB))
        time.sleep(1.0)
        bound = CONNECTIONS * (sent_mib + 2) * MiB  # what was sent, plus a huge page each
        assert grown(proc, before) < bound + 16 * MiB
        for sock in socks:
            sock.close()
        healthy(address)


def tuple_of(address: str) -> tuple[str, int]:
    host, port = address.split(":")
    return host, int(port)


def healthy(address: str) -> None:
    """A real blob whose chunks are larger than ``LAZY_FROM`` goes in and comes back whole; nothing is left."""
    state = make_state(layers=2, tokens=4096)  # 4 MiB per tensor: chunks of 4 MiB
    kv_id, frames = blob_frames(state, chunk_size=4 * MiB)

    async def scenario() -> None:
        await push(address, kv_id, frames, timeout_s=10.0)
        assert_same(await pull(address, kv_id, BlobReader(), timeout_s=10.0), state)
        await release(address, kv_id, timeout_s=5.0)
        for _ in range(50):  # the attack's Puts are aborted once their connections close
            if (await stat(address, timeout_s=5.0))["blobs"] == 0:
                return
            await asyncio.sleep(0.1)
        raise AssertionError("blobs left in the relay's store")

    asyncio.run(scenario())
