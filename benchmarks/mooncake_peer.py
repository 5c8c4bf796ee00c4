"""Mooncake Transfer Engine peer for benchmarks/transport.py; runs in the benchmark's own Mooncake virtualenv.

    mooncake_peer.py server HOST SIZE        prints {"segment", "addr"} and serves until stdin closes
    mooncake_peer.py client HOST SEGMENT ADDR SIZE REPEAT   prints {"seconds": [...]} (TCP transport, reads)
"""

from __future__ import annotations

import ctypes
import json
import sys
import time


def engine(host: str):  # type: ignore[no-untyped-def]
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake: initialize failed")
    return te


def buffer(te, size: int) -> int:  # type: ignore[no-untyped-def]
    buf = ctypes.create_string_buffer(size)
    buffer.keep = buf  # type: ignore[attr-defined]
    addr = ctypes.addressof(buf)
    if te.register_memory(addr, size) != 0:
        raise SystemExit("mooncake: register_memory failed")
    return addr


def main() -> None:
    role, host = sys.argv[1], sys.argv[2]
    te = engine(host)
    if role == "server":
        size = int(sys.argv[3])
        addr = buffer(te, size)
        print(json.dumps({"segment": f"{host}:{te.get_rpc_port()}", "addr": addr}), flush=True)
        sys.stdin.read()
        return
    segment, remote, size, repeat = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    local = buffer(te, size)
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        if te.transfer_sync_read(segment, local, remote, size) != 0:
            raise SystemExit("mooncake: transfer_sync_read failed")
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
