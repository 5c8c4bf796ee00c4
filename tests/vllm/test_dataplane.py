"""The connector's ``DataPlane`` on its own (no vLLM, no torch: it is plain numpy), with real sockets: a relay
store (``BlobStore`` + ``TransferServer``) on a loop thread of this process, or a relay that has stopped reading.

- relay and direct mode: a blob of many layers, handed over from a thread standing in for vLLM's worker, arrives
  byte for byte; the consumer's pull + release leave no blob in either store; the push's (relay mode) and the
  pull's ``TCP_INFO`` per peer are in the connector's ``tcp_file``, as its instance reads it for heartbeats;
- layers held until the step's end (``overlap`` "step", vLLM on CPU) are encoded only at ``finish``: until then
  the begun blob holds its header alone, and a consumer's pull already waits on it; a blob holds them back for at
  most half of ``kv_transfer_timeout_s`` (a pull takes a longer silence for a stall);
- a relay that stops reading (a stalled WAN link): the push holds at most ``PUSH_QUEUE_BYTES`` (plus one frame)
  the relay has not taken, the encoder waits at most ``kv_transfer_timeout_s`` for room and the worker waits
  behind it (back-pressure), then the push is refused and the rest of the blob dropped at once; nothing is left
  (thread, socket, blob).
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prfaas.kv.format import BlobHeader
from prfaas.kv.kvid import new_kv_id
from prfaas.kv.state import LayerState
from prfaas.services.sinks import PUSH_QUEUE_BYTES
from prfaas.vllm.dataplane import DataPlane
from prfaas.vllm.server import read_tcp_peers
from prfaas.vllm.settings import ConnectorSettings
from tests.transfer.helpers import FP, assert_clean
from tests.vllm.servers import StoreThread

LAYER_BYTES = 8 << 20
LAYERS = 16  # 128 MiB: more than the push queue and the encoder's queue hold
CHUNK = 1 << 20
TIMEOUT_S = 1.0


@pytest.fixture
def relay() -> Iterator[StoreThread]:
    relay = StoreThread()
    yield relay
    relay.close()


def _layers() -> list[LayerState]:
    rng = np.random.default_rng(0)
    return [LayerState(i, "full_attention", True, None,
                       {"blocks": rng.standard_normal(LAYER_BYTES // 4, dtype=np.float32).reshape(8, -1)},
                       {"layer": f"model.layers.{i}.self_attn.attn"}) for i in range(LAYERS)]


def _header(layers: list[LayerState]) -> BlobHeader:
    return BlobHeader(kv_id=new_kv_id(FP.short_hash()), fingerprint=FP, codec="none", seq_len=1024,
                      cache="vllm-paged-blocks", chunk_size=CHUNK, layers=tuple(x.table_entry() for x in layers),
                      created_ms=int(time.time() * 1000))


def _write(plane: DataPlane, layers: list[LayerState], relay: str | None, hold: bool = False) -> str:
    """Hand the blob over from a thread of its own, as vLLM's worker does; returns its kv_id."""
    header = _header(layers)

    def worker() -> None:
        plane.begin(header, relay)
        for layer in layers:
            plane.add_layer(header.kv_id, layer, hold=hold)
        plane.finish(header.kv_id)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    return header.kv_id


def _plane_threads() -> list[str]:
    """The data planes' loop threads alive (prfaas's verify pool is the process's, shared, and stays)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("prfaas-kv")]


@pytest.mark.parametrize("hold", [False, True], ids=["layers", "step"])
@pytest.mark.parametrize("mode", ["relay", "direct"])
def test_a_blob_arrives_whole_and_nothing_is_left(relay: StoreThread, mode: str, hold: bool, tmp_path: Path
                                                  ) -> None:
    tcp_file = str(tmp_path / "tcp_peers.json")
    plane = DataPlane(ConnectorSettings(kv_address="127.0.0.1:0" if mode == "direct" else None,
                                        relay=relay.address if mode == "relay" else None, tcp_file=tcp_file))
    try:
        address = relay.address if mode == "relay" else f"127.0.0.1:{plane.serve('127.0.0.1:0')}"
        layers = _layers()
        kv_id = _write(plane, layers, relay.address if mode == "relay" else None, hold)
        state = plane.pull(address, kv_id).result(60)
        assert [sent.tensors["blocks"].tobytes() == got.tensors["blocks"].tobytes()
                for sent, got in zip(layers, state.layers, strict=True)] == [True] * LAYERS
        plane.release(address, kv_id).result(30)
        if mode == "direct":
            assert plane.stats()["blobs"] == 0
        # the TCP figures the instance's heartbeat carries: the push's (relay mode) and the pull's, per peer
        peers = read_tcp_peers(tcp_file, [])
        assert [p.peer for p in peers] == [address] * (2 if mode == "relay" else 1), peers
        assert all(p.rtt_ms > 0 and p.retransmits >= 0 for p in peers) and not os.path.exists(f"{tcp_file}.tmp")
    finally:
        plane.close()
    assert_clean(relay.store)
    assert not _plane_threads()


@pytest.mark.parametrize("hold", [False, True], ids=["layers", "step"])
def test_a_layer_is_read_only_after_its_copy_is_ready(hold: bool) -> None:
    """On a GPU a saved layer's bytes are still on their way to host memory when the worker hands it over; the
    encoder calls the layer's ``ready`` first. Here ``ready`` itself writes the bytes: the blob must hold them."""
    plane = DataPlane(ConnectorSettings(kv_address="127.0.0.1:0"))
    try:
        address = f"127.0.0.1:{plane.serve('127.0.0.1:0')}"
        layers = _layers()[:3]
        expected = [x.tensors["blocks"].copy() for x in layers]
        for layer in layers:
            layer.tensors["blocks"][:] = 0  # not there yet
        header = _header(layers)
        plane.begin(header)
        for layer, content in zip(layers, expected, strict=True):
            plane.add_layer(header.kv_id, layer, hold=hold,
                            ready=functools.partial(np.copyto, layer.tensors["blocks"], content))
        plane.finish(header.kv_id)
        state = plane.pull(address, header.kv_id).result(60)
        assert [x.tensors["blocks"].tobytes() for x in state.layers] == [x.tobytes() for x in expected]
        plane.release(address, header.kv_id).result(30)
    finally:
        plane.close()
    assert not _plane_threads()


def test_held_layers_are_encoded_at_the_steps_end_while_a_pull_waits() -> None:
    plane = DataPlane(ConnectorSettings(kv_address="127.0.0.1:0"))
    try:
        address = f"127.0.0.1:{plane.serve('127.0.0.1:0')}"
        layers = _layers()[:4]
        header = _header(layers)
        plane.begin(header)
        for layer in layers:
            plane.add_layer(header.kv_id, layer, hold=True)
        deadline = time.monotonic() + 10
        while plane.stats()["writing"] != 1 and time.monotonic() < deadline:  # begun: the encoder opened it
            time.sleep(0.01)
        pulling = plane.pull(address, header.kv_id)
        time.sleep(0.5)
        assert plane.stats()["writing"] == 1 and plane.stats()["bytes"] < CHUNK, plane.stats()  # the header only
        assert not pulling.done()
        plane.finish(header.kv_id)
        state = pulling.result(60)
        assert [x.tensors["blocks"].tobytes() for x in state.layers] == [x.tensors["blocks"].tobytes()
                                                                         for x in layers]
        plane.release(address, header.kv_id).result(30)
        assert plane.stats()["blobs"] == 0
    finally:
        plane.close()
    assert not _plane_threads()


def test_a_blob_holds_its_layers_back_for_at_most_half_a_pulls_stall_timeout() -> None:
    plane = DataPlane(ConnectorSettings(kv_address="127.0.0.1:0", kv_transfer_timeout_s=0.4))
    try:
        plane.serve("127.0.0.1:0")
        layers = _layers()[:3]
        header = _header(layers)
        plane.begin(header)
        plane.add_layer(header.kv_id, layers[0], hold=True)
        time.sleep(0.3)  # past the 0.2 s a pull would wait for nothing
        plane.add_layer(header.kv_id, layers[1], hold=True)  # sent, with the one held before it
        deadline = time.monotonic() + 10
        while plane.stats()["bytes"] < 2 * LAYER_BYTES and time.monotonic() < deadline:
            time.sleep(0.01)
        assert plane.stats()["bytes"] >= 2 * LAYER_BYTES, plane.stats()
        plane.add_layer(header.kv_id, layers[2], hold=True)
        plane.finish(header.kv_id)
    finally:
        plane.close()
    assert not _plane_threads()


def _stalled_relay() -> socket.socket:
    """A listener that completes the handshake but never reads: what a link that stopped looks like."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    return listener


def test_a_stalled_relay_holds_the_push_to_its_bound_then_refuses_it(caplog: pytest.LogCaptureFixture) -> None:
    listener = _stalled_relay()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    plane = DataPlane(ConnectorSettings(relay=address, kv_transfer_timeout_s=TIMEOUT_S, kv_deadline_s=30))
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], plane.pushing_bytes())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        started = time.monotonic()
        kv_id = _write(plane, _layers(), address)
        took = time.monotonic() - started
    finally:
        stop.set()
        watcher.join(10)
        plane.close()
        listener.close()
    print(f"\npeak queued {peak[0] / 2**20:.1f} MiB of {LAYERS * LAYER_BYTES / 2**20:.0f} MiB; worker blocked "
          f"{took:.2f} s")
    assert PUSH_QUEUE_BYTES / 2 < peak[0] <= PUSH_QUEUE_BYTES + CHUNK + 64, peak
    assert TIMEOUT_S * 0.9 < took < TIMEOUT_S + 10  # waited for room once, then the rest was dropped at once
    assert f"blob {kv_id} not written (KV_TIMEOUT" in caplog.text
    assert not _plane_threads()
