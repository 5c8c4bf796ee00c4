"""A Put's ``ttl_ms`` is capped by the store's configuration: a real relay refuses (``KV_BAD_FORMAT``) a TTL
longer than ``kv_ttl_seconds`` or any tenant's override, so no writer can keep a blob alive past what the
deployment allows; TTLs within the cap are kept, and nothing is left behind."""

from __future__ import annotations

import asyncio
import socket
import struct
from pathlib import Path

import pytest
import yaml

from prfaas.errors import KVBadFormat
from prfaas.transfer import protocol as p
from prfaas.transfer import push, release, stat
from tests.transfer.helpers import blob_frames, make_state
from tests.transfer.test_memory_bound import store_process

HUGE_S = float(2**40)


@pytest.mark.parametrize("role", ["relay", "prefill"])  # the prefill's store serves direct mode
def test_a_put_cannot_outlive_the_configured_ttl(tmp_path: Path, role: str) -> None:
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump({"kv_ttl_seconds": 60, "tenants": {"slow": {"kv_ttl_seconds": 240}}}))

    async def scenario(address: str) -> None:
        for n, ttl_s in enumerate((HUGE_S, 241.0)):  # 2^40 s: the attack; 241 s: one past the longest allowed
            kv_id, frames = blob_frames(make_state(layers=1, tokens=16, seed=n))
            with pytest.raises(KVBadFormat, match="TTL"):
                put(address, p.Put(kv_id, 30_000, ttl_ms=int(ttl_s * 1000)), frames[0])
        for n, (tenant, ttl_s) in enumerate((("", 60.0), ("slow", 240.0), ("", 0.0))):
            kv_id, frames = blob_frames(make_state(layers=1, tokens=16, seed=10 + n))
            await push(address, kv_id, frames, timeout_s=5.0, tenant=tenant, ttl_s=ttl_s)
            await release(address, kv_id, timeout_s=5.0)
        assert (await stat(address, timeout_s=5.0))["blobs"] == 0

    with store_process(role, str(config)) as (address, _):
        asyncio.run(scenario(address))


def put(address: str, request: p.Put, header: bytes) -> None:
    """The start of a Put on a plain socket (the request and the blob's header frame), then its reply, raised if
    it is an error (what a pushing prefill would see before it sends any chunk)."""
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=5.0) as sock:
        sock.sendall(p.encode(request) + header)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    n = struct.unpack(">I", reply[1:5])[0]
    p.expect(p.decode(reply[9:9 + n]), p.Ok)
