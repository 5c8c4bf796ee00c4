"""``prfaas bench transfer``: move a KV-shaped blob through the real store and transfer code and report goodput.

Without ``--target`` a relay (``BlobStore`` + ``TransferServer``) starts in a child process on 127.0.0.1 (TLS 1.3
with a throw-away self-signed certificate when ``--tls``); the blob is pushed once, then pulled ``--repeat`` times
with ``--streams`` connections into a fresh ``BlobReader`` (every chunk verified, layers rebuilt), then released.
Goodput counts payload bytes only: Gbit/s = payload bytes × 8 / seconds / 1e9. ``--json`` prints one object last:
``bytes, seconds, gbps`` (the best pull), ``median_gbps``, ``push_seconds``, ``push_gbps``, ``streams``,
``chunk_kb``, ``tls``, ``repeat``, ``target``, and ``cpu_s_per_gb``: this (receiving) process's CPU seconds per GB
pulled, all its threads, the median over the pulls; with the local relay also ``server_cpu_s_per_gb``, the relay
process's (sending) CPU seconds per GB pulled, the median over the pulls.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import ssl
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import typer

from prfaas.units import parse_size

LAYERS, HEADS, DIM = 32, 8, 128


def make_frames(nbytes: int, chunk_bytes: int) -> tuple[str, list[bytes], int]:
    """``(kv_id, frames, payload bytes)`` of a float16 full-attention blob of about ``nbytes``."""
    import numpy as np

    from prfaas.kv import BlobWriter, Fingerprint, KVState, LayerState
    from prfaas.kv.format import CHUNK_HEAD_SIZE

    per_tensor = max(HEADS * DIM * 2, nbytes // (2 * LAYERS))
    tokens = per_tensor // (HEADS * DIM * 2)
    rng = np.random.default_rng(0)
    block = np.frombuffer(rng.bytes(HEADS * tokens * DIM * 2), dtype=np.float16).reshape(1, HEADS, tokens, DIM)
    layers = [LayerState(i, "full_attention", True, None, {"keys": block, "values": block}) for i in range(LAYERS)]
    state = KVState(Fingerprint("bench", "llama", "a" * 16, "b" * 16, "float16", 1 << 20), tokens, layers,
                    first_token=1)
    writer = BlobWriter.for_state(state, chunk_size=chunk_bytes)
    frames = [writer.header_frame()]
    for layer in layers:
        frames.extend(writer.add_layer(layer))
    frames.extend(writer.finish(1))
    return writer.header.kv_id, frames, sum(len(f) for f in frames[1:-1]) - (len(frames) - 2) * CHUNK_HEAD_SIZE


def self_signed(directory: Path, ips: tuple[str, ...] = ("127.0.0.1",)) -> tuple[Path, Path]:
    """A throw-away P-256 certificate for ``ips`` (needs the ``openssl`` command)."""
    cert, key = directory / "relay.pem", directory / "relay.key"
    san = ",".join(f"IP:{ip}" for ip in ips)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={ips[0]}",
                    "-addext", f"subjectAltName={san}"], check=True, capture_output=True)
    return cert, key


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    return ctx


def client_context(ca: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def relay_main(budget: int, cert: str | None, key: str | None, ports: Any, stop: Any) -> None:
    """Child process: a store behind a transfer server until ``stop`` gets an item."""
    from prfaas.store import BlobStore
    from prfaas.transfer import TransferServer

    async def main() -> None:
        tls = server_context(Path(cert), Path(key)) if cert and key else None
        server = TransferServer(BlobStore(budget, 300), ssl=tls)
        ports.put(await server.start())
        while stop.empty():
            await asyncio.sleep(0.05)
        await server.close()

    asyncio.run(main())


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far, all its threads; None where unreadable."""
    import psutil

    if pid is None:
        return None
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system)


async def measure(address: str, kv_id: str, frames: list[bytes], payload: int, streams: int, repeat: int,
                  tls: ssl.SSLContext | None, peer_pid: int | None = None) -> dict[str, Any]:
    from prfaas.kv import BlobReader
    from prfaas.transfer import pull, push, release

    started = time.perf_counter()
    await push(address, kv_id, frames, ssl=tls, timeout_s=30.0)
    push_s = time.perf_counter() - started
    times, cpu, peer_cpu = [], [], []
    try:
        for _ in range(repeat):
            started, cpu_started, peer_started = time.perf_counter(), time.process_time(), process_cpu_s(peer_pid)
            await pull(address, kv_id, BlobReader(max_bytes=payload + (64 << 20)), timeout_s=30.0, streams=streams,
                       ssl=tls, retries=0)
            times.append(time.perf_counter() - started)
            cpu.append((time.process_time() - cpu_started) / payload * 1e9)
            peer_now = process_cpu_s(peer_pid)
            if peer_started is not None and peer_now is not None:
                peer_cpu.append((peer_now - peer_started) / payload * 1e9)
    finally:
        await release(address, kv_id, ssl=tls)
    best = min(times)
    return {"bytes": payload, "seconds": best, "gbps": payload * 8 / best / 1e9,
            "median_gbps": payload * 8 / statistics.median(times) / 1e9, "push_seconds": push_s,
            "push_gbps": payload * 8 / push_s / 1e9, "pull_seconds": times, "cpu_s_per_gb": statistics.median(cpu),
            **({"server_cpu_s_per_gb": statistics.median(peer_cpu)} if peer_cpu else {})}


def run_bench(size: int, streams: int, chunk_kb: int, use_tls: bool, target: str | None, repeat: int,
              ca: str | None = None) -> dict[str, Any]:
    """One benchmark run; returns the JSON object ``prfaas bench transfer --json`` prints."""
    kv_id, frames, payload = make_frames(size, chunk_kb * 1024)
    meta = {"streams": streams, "chunk_kb": chunk_kb, "tls": use_tls, "repeat": repeat, "target": target or ""}
    if target:
        tls = client_context(Path(ca)) if use_tls and ca else (ssl.create_default_context() if use_tls else None)
        return {**asyncio.run(measure(target, kv_id, frames, payload, streams, repeat, tls)), **meta}
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = self_signed(Path(tmp)) if use_tls else (None, None)
        ctx = mp.get_context("spawn")
        ports, stop = ctx.Queue(), ctx.Queue()
        relay = ctx.Process(target=relay_main, args=(size * 2 + (256 << 20), str(cert) if cert else None,
                                                     str(key) if key else None, ports, stop), daemon=True)
        relay.start()
        try:
            address = f"127.0.0.1:{ports.get(timeout=60)}"
            tls = client_context(cert) if cert else None
            return {**asyncio.run(measure(address, kv_id, frames, payload, streams, repeat, tls, relay.pid)), **meta}
        finally:
            stop.put(True)
            relay.join(10)
            if relay.is_alive():
                relay.kill()
                relay.join()


def transfer(
    size: str = typer.Option("1GiB", help="blob payload size (1GiB, 256MiB, …)"),
    streams: int = typer.Option(1, help="TCP connections per pull, striped by chunk"),
    chunk_kb: int = typer.Option(1024, "--chunk-kb", help="chunk size in KiB (1–8 MiB is the sane range)"),
    tls: bool = typer.Option(False, "--tls", help="TLS 1.3 on the data plane"),
    target: str = typer.Option("", help="HOST:PORT of a running store (default: start one on 127.0.0.1)"),
    ca: Path | None = typer.Option(None, "--ca", envvar="PRFAAS_CA", show_envvar=True, exists=True, dir_okay=False,
                                   help="with --target --tls: the CA file that signed the target's certificate"),
    repeat: int = typer.Option(3, help="pulls to time (the best and the median are reported)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on the last line"),
) -> None:
    """Push then pull a KV-shaped blob through the real store and transfer code; report goodput."""
    out = run_bench(parse_size(size), streams, chunk_kb, tls, target or None, max(1, repeat), str(ca) if ca else None)
    if as_json:
        typer.echo(json.dumps(out))
        return
    typer.echo(f"{out['bytes'] / 2**20:.0f} MiB, {streams} stream(s), {chunk_kb} KiB chunks, "
               f"{'TLS 1.3' if tls else 'plaintext'}: pull {out['gbps']:.2f} Gbit/s best "
               f"({out['median_gbps']:.2f} median), push {out['push_gbps']:.2f} Gbit/s")
