"""``PrfaasConnector`` inside real vLLM processes (the CPU build in ``.venv-vllm``, SmolLM2-135M fp32): one
producer (prefill, direct mode: its own prfaas store on the data plane) and one consumer (decode), driven with
vLLM's P/D protocol over HTTP, as vLLM's toy proxy does.

- the prompt's KV crosses as a prfaas blob: the consumer's greedy tokens equal a monolithic run token for token,
  and vLLM's metrics say the prompt came from ``external_kv_transfer`` (all but the last token), not recomputed;
- relay mode, chosen per request (``kv_transfer_params.relay``): the producer pushes the blob into a relay store
  (a real ``TransferServer`` in this process) and the consumer pulls it from there, as exact;
- a byte damaged on the wire is caught by the chunk checksum and fetched again (the KV is still used, exact);
- a blob that does not exist, and one whose fingerprint says another layout (``KV_INCOMPATIBLE``), end in the same
  tokens by recompute (``kv_load_failure_policy: recompute``), bounded in time;
- no blob is left in the producer's store and no process is left behind.

Skips only where vLLM's CPU build is not installed (``make vllm``). Both servers start once for the module
(about 50-90 s on 2 cores).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from prfaas.kv.format import BlobReader, BlobWriter
from prfaas.kv.kvid import new_kv_id
from prfaas.transfer import client
from tests.services.deploy import free_port
from tests.vllm.servers import (
    COMPILED_START_S,
    MODEL,
    NEEDS_VLLM,
    Server,
    StoreThread,
    complete,
    prompt_sources,
    start,
    stop,
    wait_healthy,
    wait_no_blobs,
)

RECOVER_S = 60.0  # a failed load plus the recompute
PROMPT = " ".join(f"The number {i} is followed by {i + 1}." for i in range(40))  # about 460 tokens: 4 blocks
BODY: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 0}

pytestmark = [
    pytest.mark.slow,
    NEEDS_VLLM,
]


@dataclass
class Pair:
    prefill: Server
    decode: Server
    kv_address: str
    relay: Relay
    reference: dict[str, Any]  # the monolithic completion (the prefill instance, without any transfer)


class Relay(StoreThread):
    """A relay store (``BlobStore`` + ``TransferServer``) and a damaging TCP proxy, on a loop thread of this
    process. The proxy forwards to ``upstream``; while ``damage`` is set, the first connection through it gets one
    byte of the server's stream flipped at ``FLIP_AT`` (inside the first chunk's data)."""

    FLIP_AT = 100_000

    def __init__(self) -> None:
        super().__init__()
        self.upstream = ""
        self.damage = False
        self.connections = 0
        self.proxy: asyncio.Server | None = None
        self.proxy_address = f"127.0.0.1:{self.call(self._start_proxy())}"

    async def _start_proxy(self) -> int:
        self.proxy = await asyncio.start_server(self._relay_connection, "127.0.0.1", 0)
        return int(self.proxy.sockets[0].getsockname()[1])

    async def _relay_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        flip, self.damage = self.damage, False
        host, port = self.upstream.rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(self._pump(reader, up_writer, False), self._pump(up_reader, writer, flip),
                             return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flip: bool) -> None:
        seen = 0
        try:
            while data := await reader.read(1 << 16):
                if flip and seen <= self.FLIP_AT < seen + len(data):
                    damaged = bytearray(data)
                    damaged[self.FLIP_AT - seen] ^= 0xFF
                    data, flip = bytes(damaged), False
                seen += len(data)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def blobs(self) -> int:
        return int(self.store.stats().to_dict()["blobs"])

    async def _stop(self) -> None:
        assert self.proxy is not None
        self.proxy.close()
        await super()._stop()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    from prfaas.engine import models

    model_dir = models.smollm2_dir()
    kv_address, relay = f"127.0.0.1:{free_port()}", Relay()
    relay.upstream = kv_address
    # vLLM's default, its compiled graph (as `prfaas up --engine vllm` runs it): the connector's hooks run inside it
    prefill = start(model_dir, "kv_producer", {"kv_address": kv_address, "relays": [relay.address]}, eager=False)
    decode = start(model_dir, "kv_consumer", {"creation_grace_s": 1, "kv_deadline_s": 20}, eager=False)
    left: list[int] = []
    try:
        started = time.monotonic()
        wait_healthy([prefill, decode], COMPILED_START_S)
        print(f"vLLM producer and consumer healthy in {time.monotonic() - started:.1f} s")
        yield Pair(prefill, decode, kv_address, relay, complete(prefill, BODY))
        assert wait_no_blobs(kv_address), "blobs left in the producer's store"
        assert relay.blobs() == 0, "blobs left in the relay's store"
    finally:
        left = stop(prefill) + stop(decode)
        relay.close()
    assert not left, f"processes left behind: {left}"


def _tokens(completion: dict[str, Any]) -> list[str]:
    return list(completion["choices"][0]["logprobs"]["tokens"])


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def _prefill_remote(pair: Pair, relay: str | None = None) -> dict[str, Any]:
    """The producer's half: max_tokens 1 and do_remote_decode; returns the kv_transfer_params it answered."""
    asked = {"do_remote_decode": True, **({"relay": relay} if relay else {})}
    reply = complete(pair.prefill, {**BODY, "max_tokens": 1, "kv_transfer_params": asked})
    params = reply.get("kv_transfer_params") or {}
    assert params.get("do_remote_prefill") and params.get("kv_id"), reply
    assert params["kv_address"] == (relay or pair.kv_address)
    assert params["kv_tokens"] == reply["usage"]["prompt_tokens"]
    return dict(params)


def _decode(pair: Pair, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float], float]:
    before = prompt_sources(pair.decode)
    started = time.monotonic()
    reply = complete(pair.decode, {**BODY, "kv_transfer_params": params})
    return reply, _delta(before, prompt_sources(pair.decode)), time.monotonic() - started


def test_remote_prefill_is_exact_and_not_recomputed(pair: Pair) -> None:
    params = _prefill_remote(pair)
    reply, sources, _ = _decode(pair, params)
    assert reply["choices"][0]["text"] == pair.reference["choices"][0]["text"]
    _assert_kv_used(pair, reply, sources)  # all but the last prompt token: vLLM computes it for its logits
    assert wait_no_blobs(pair.kv_address), "the consumer did not release the blob"


def _assert_kv_used(pair: Pair, reply: dict[str, Any], sources: dict[str, float]) -> None:
    assert _tokens(reply) == _tokens(pair.reference)
    assert sources["external_kv_transfer"] == reply["usage"]["prompt_tokens"] - 1, sources
    assert sources["local_compute"] == 1, sources


def test_relay_mode_per_request(pair: Pair) -> None:
    params = _prefill_remote(pair, relay=pair.relay.address)
    reply, sources, _ = _decode(pair, params)
    _assert_kv_used(pair, reply, sources)
    deadline = time.monotonic() + 10
    while pair.relay.blobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pair.relay.blobs() == 0, "the consumer did not release the blob at the relay"


def test_relay_not_allowed_is_refused(pair: Pair) -> None:
    """A request cannot make the producer push KV to an address it was not configured with."""
    reply = complete(pair.prefill, {**BODY, "max_tokens": 1,
                                     "kv_transfer_params": {"do_remote_decode": True, "relay": "127.0.0.1:9"}})
    assert not (reply.get("kv_transfer_params") or {}).get("kv_id")


def test_damaged_byte_is_fetched_again(pair: Pair) -> None:
    """One byte flipped inside the first chunk on the wire: the chunk's xxHash64 catches it, the pull resumes on a
    new connection, and the KV is still used (not recomputed)."""
    params = _prefill_remote(pair)
    before = pair.relay.connections
    pair.relay.damage = True
    reply, sources, _ = _decode(pair, {**params, "kv_address": pair.relay.proxy_address})
    assert not pair.relay.damage and pair.relay.connections - before >= 3  # damaged pull, clean pull, release
    _assert_kv_used(pair, reply, sources)


def test_missing_blob_is_recomputed(pair: Pair) -> None:
    params = {"do_remote_prefill": True, "kv_id": new_kv_id("0" * 12), "kv_address": pair.kv_address}
    reply, sources, seconds = _decode(pair, params)
    assert _tokens(reply) == _tokens(pair.reference)
    assert sources["external_kv_transfer"] == 0 and sources["local_compute"] == reply["usage"]["prompt_tokens"]
    assert seconds < RECOVER_S
    assert f"{params['kv_id']}) failed, KV_NOT_FOUND" in pair.decode.text()


def test_incompatible_blob_is_refused_and_recomputed(pair: Pair) -> None:
    """The producer's real blob, re-sent under a fingerprint naming another KV dtype: the consumer must refuse it
    (KV_INCOMPATIBLE), never read its bytes as its own layout, and recompute."""
    original = _prefill_remote(pair)
    forged = asyncio.run(_forge(pair.kv_address, original["kv_id"]))
    reply, sources, seconds = _decode(pair, {**original, "kv_id": forged})
    assert _tokens(reply) == _tokens(pair.reference)
    assert sources["external_kv_transfer"] == 0 and sources["local_compute"] == reply["usage"]["prompt_tokens"]
    assert seconds < RECOVER_S
    assert f"{forged}) failed, KV_INCOMPATIBLE" in pair.decode.text()
    assert wait_no_blobs(pair.kv_address), "the refused blob was not released"


async def _forge(address: str, kv_id: str) -> str:
    """Pull blob ``kv_id`` out of the store at ``address``, release it, and push its layers back under a new id
    with the fingerprint's dtype changed; returns the new id."""
    state = await client.pull(address, kv_id, BlobReader(), timeout_s=10)
    await client.release(address, kv_id)
    state.fingerprint = dataclasses.replace(state.fingerprint, dtype="bfloat16")
    forged = new_kv_id(state.fingerprint.short_hash())
    writer = BlobWriter.for_state(state, kv_id=forged)
    frames = [writer.header_frame()]
    for layer in state.layers:
        frames += writer.add_layer(layer)
    frames += writer.finish(None)
    await client.push(address, forged, frames, timeout_s=10)
    return forged
