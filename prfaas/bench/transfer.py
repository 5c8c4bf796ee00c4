"""``prfaas bench transfer``: move a KV-shaped blob through the real store and transfer code and report goodput.

Without ``--target`` a relay (``BlobStore`` + ``TransferServer``) starts in a child process on 127.0.0.1 (TLS 1.3
with a throw-away self-signed certificate when ``--tls``); the blob is pushed once, then pulled ``--repeat`` times
with ``--streams`` connections into a fresh ``BlobReader`` (every chunk verified, layers rebuilt), then released.
Goodput counts payload bytes only: Gbit/s = payload bytes × 8 / seconds / 1e9. ``--json`` prints one object last:
``bytes, seconds, gbps`` (the best pull), ``median_gbps``, ``push_seconds``, ``push_gbps``, ``streams``,
``chunk_kb``, ``tls``, ``repeat``, ``target``, ``pull_seconds`` and ``pull_cpu_s_per_gb`` (every pull, in order), and
``cpu_s_per_gb``: this (receiving) process's CPU seconds per GB pulled, all its threads, the median over the pulls;
with the local relay also ``server_cpu_s_per_gb``, the relay
process's (sending) CPU seconds per GB pulled, the median over the pulls.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import ssl
import statistics
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
    from prfaas.kv.format import CHUNK_HEAD_SIZE, state_frames

    per_tensor = max(HEADS * DIM * 2, nbytes // (2 * LAYERS))
    tokens = per_tensor // (HEADS * DIM * 2)
    rng = np.random.default_rng(0)
    block = np.frombuffer(rng.bytes(HEADS * tokens * DIM * 2), dtype=np.float16).reshape(1, HEADS, tokens, DIM)
    layers = [LayerState(i, "full_attention", True, None, {"keys": block, "values": block}) for i in range(LAYERS)]
    state = KVState(Fingerprint("bench", "llama", "a" * 16, "b" * 16, "float16", 1 << 20), tokens, layers,
                    first_token=1)
    writer = BlobWriter.for_state(state, chunk_size=chunk_bytes)
    frames = list(map(bytes, state_frames(writer, state)))
    return writer.header.kv_id, frames, sum(len(f) for f in frames[1:-1]) - (len(frames) - 2) * CHUNK_HEAD_SIZE


def self_signed(directory: Path, ips: tuple[str, ...] = ("127.0.0.1",)) -> tuple[Path, Path]:
    """A throw-away P-256 certificate for ``ips``, valid for a day, that is its own CA (clients trust it as
    ``cafile``): ``relay.pem`` and ``relay.key`` in ``directory``."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ips[0])])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "relay.pem", directory / "relay.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


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
    from prfaas.limits import DEFAULT
    from prfaas.transfer import TransferContext, pull, push, release

    context = TransferContext.for_role(DEFAULT, tls, max_inflight_kv=0)  # a decode role's: arenas reused
    started = time.perf_counter()
    await push(address, kv_id, frames, ssl=tls, timeout_s=30.0)
    push_s = time.perf_counter() - started
    times, cpu, peer_cpu = [], [], []
    try:
        for _ in range(repeat):
            started, cpu_started, peer_started = time.perf_counter(), time.process_time(), process_cpu_s(peer_pid)
            await pull(address, kv_id, BlobReader(max_bytes=payload + (64 << 20)), timeout_s=30.0, streams=streams,
                       retries=0, context=context)
            times.append(time.perf_counter() - started)
            cpu.append((time.process_time() - cpu_started) / payload * 1e9)
            peer_now = process_cpu_s(peer_pid)
            if peer_started is not None and peer_now is not None:
                peer_cpu.append((peer_now - peer_started) / payload * 1e9)
    finally:
        await release(address, kv_id, ssl=tls)
        context.close()
    best = min(times)
    return {"bytes": payload, "seconds": best, "gbps": payload * 8 / best / 1e9,
            "median_gbps": payload * 8 / statistics.median(times) / 1e9, "push_seconds": push_s,
            "push_gbps": payload * 8 / push_s / 1e9, "pull_seconds": times, "pull_cpu_s_per_gb": cpu,
            "cpu_s_per_gb": statistics.median(cpu),
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
