"""Loopback throughput of the KV data plane: a relay process serves a KV-shaped blob from its ``BlobStore``; this
process pushes it, then pulls it back several ways.

    .venv/bin/python benchmarks/transfer_loopback.py [--mib 256] [--chunk-kb 1024] [--repeat 3]
        [--out benchmarks/out/transfer_loopback.json]

Rows (best and median of ``--repeat`` runs, GB/s = payload bytes / seconds / 1e9, Gbit/s = × 8):
  push          prefill → relay: frames streamed into the remote store (store verifies every chunk)
  pull frames   Get + read every frame off the socket, no checksum, no decode (the transport's ceiling here)
  pull state    ``prfaas.transfer.pull`` into a ``BlobReader``: every chunk verified, layers rebuilt as numpy
Both processes share this machine's cores, so client and server compete for CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from prfaas.bench.provenance import provenance
from prfaas.kv import BlobReader, BlobWriter, Fingerprint, KVState, LayerState, new_kv_id
from prfaas.kv.format import CHUNK_HEAD_SIZE, state_frames
from prfaas.store import BlobStore
from prfaas.transfer import TransferContext, TransferServer, pull, push, release
from prfaas.transfer import protocol as p
from prfaas.transfer.conn import close, connect

FP = Fingerprint("bench", "llama", "a" * 16, "b" * 16, "float16", 32768)
HEADS, DIM, LAYERS = 8, 128, 32


def make_state(mib: int) -> KVState:
    """``LAYERS`` full-attention layers of float16 K and V adding up to ``mib`` MiB (random bits)."""
    per_tensor = (mib << 20) // (2 * LAYERS)
    tokens = per_tensor // (HEADS * DIM * 2)
    rng = np.random.default_rng(0)
    shape = (1, HEADS, tokens, DIM)

    def tensor() -> np.ndarray:
        return np.frombuffer(rng.bytes(per_tensor), dtype=np.float16).reshape(shape)

    layers = [LayerState(i, "full_attention", True, None, {"keys": tensor(), "values": tensor()})
              for i in range(LAYERS)]
    return KVState(FP, tokens, layers, first_token=1)


def frames_of(state: KVState, chunk: int) -> list[bytes]:
    return list(state_frames(BlobWriter.for_state(state, chunk_size=chunk), state))


def header_for(state: KVState, kv_id: str, like: bytes) -> bytes:
    reader = BlobReader()
    reader.feed(like)
    assert reader.header is not None
    return BlobWriter(dataclasses.replace(reader.header, kv_id=kv_id)).header_frame()


def relay_main(budget: int, ports: Any, stop: Any) -> None:
    async def main() -> None:
        store = BlobStore(budget, 300)
        server = TransferServer(store)
        ports.put(await server.start())
        while stop.empty():
            await asyncio.sleep(0.1)
        await server.close()
        store.close()

    asyncio.run(main())


async def pull_frames(address: str, kv_id: str) -> int:
    stream, writer = await connect(address, None, 10)
    writer.write(p.encode(p.Get(kv_id, 0, 10_000)))
    p.expect(await p.read_message(stream), p.Ok)
    payload = 0
    while True:
        frame = await p.read_frame(stream)
        payload += len(frame.data) if frame.tag == b"C" else 0
        if frame.tag == b"T":
            await close(writer)
            return payload


async def measure(address: str, kv_id: str, frames: list[bytes], state: KVState, repeat: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"push": [], "pull frames": [], "pull state": []}
    for i in range(repeat):
        if i:
            await release(address, kv_id)
        kv_id = new_kv_id(FP.short_hash())  # a released id is never reused; only the header names it
        start = time.perf_counter()
        await push(address, kv_id, [header_for(state, kv_id, frames[0]), *frames[1:]], timeout_s=10)
        times["push"].append(time.perf_counter() - start)
    for _ in range(repeat):
        start = time.perf_counter()
        await pull_frames(address, kv_id)
        times["pull frames"].append(time.perf_counter() - start)
    context = TransferContext()  # one role's pulls: arenas reused between them
    for _ in range(repeat):
        start = time.perf_counter()
        got = await pull(address, kv_id, BlobReader(), timeout_s=10, context=context)
        times["pull state"].append(time.perf_counter() - start)
        assert got.layers[-1].tensors["values"].tobytes() == state.layers[-1].tensors["values"].tobytes()
        del got
    await release(address, kv_id)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--chunk-kb", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/out/transfer_loopback.json")
    args = ap.parse_args()
    state = make_state(args.mib)
    frames = frames_of(state, args.chunk_kb << 10)
    payload = sum(len(f) - CHUNK_HEAD_SIZE for f in frames[1:-1])
    reader = BlobReader()
    reader.feed(frames[0])
    assert reader.header is not None
    kv_id = reader.header.kv_id
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Queue()
    relay = ctx.Process(target=relay_main, args=(4 * (args.mib << 20), ports, stop))
    relay.start()
    try:
        address = f"127.0.0.1:{ports.get(timeout=60)}"
        times = asyncio.run(measure(address, kv_id, frames, state, args.repeat))
    finally:
        stop.put(1)
        relay.join(30)
    rows = [{"op": op, "payload_bytes": payload, "chunks": len(frames) - 2, "chunk_kb": args.chunk_kb,
             "best_s": min(t), "median_s": statistics.median(t), "best_gbytes_s": payload / min(t) / 1e9,
             "median_gbytes_s": payload / statistics.median(t) / 1e9, "runs_s": t} for op, t in times.items()]
    result = {"provenance": provenance(), "host": platform.node(), "cpus": os.cpu_count(),
              "loadavg_1m": os.getloadavg()[0], "python": platform.python_version(),
              "tls": False, "streams": 1, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    table = Table(title=f"KV data plane on loopback: {payload / 2**20:.0f} MiB, {args.chunk_kb} KiB chunks, "
                        f"{os.cpu_count()} CPUs")
    for col in ("op", "best s", "median s", "best GB/s", "best Gbit/s", "median Gbit/s"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for r in rows:
        table.add_row(r["op"], f"{r['best_s']:.3f}", f"{r['median_s']:.3f}", f"{r['best_gbytes_s']:.2f}",
                      f"{r['best_gbytes_s'] * 8:.1f}", f"{r['median_gbytes_s'] * 8:.1f}")
    Console().print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
