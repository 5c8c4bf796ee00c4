"""What tenancy costs: encryption at rest (GB/s through a store, sealed against plain, side by side) and metering,
policy and redaction on the request path (microseconds per request).

    .venv/bin/python benchmarks/tenancy.py [--out benchmarks/results/tenancy.json] [--mib 256] [--repeat 3]

Sealing: KV-shaped blobs of ``--mib`` MiB in 1 MiB chunk frames are written into one ``BlobStore``, read back and
released, one after another as a relay does, on a plain ``MemoryBackend`` and on a ``SealedBackend`` over it (this
machine is shared: compare within a run). The first blob meets a fresh store; the median is over the ``--repeat``
after it. Raw AES-256-GCM on one core, its output kept, is printed beside it.
Request path: ``Meter.record`` with and without the usage log (a real file, flushed per entry), the scheduler's
route decision with and without a tenant policy, and the built-in ``mask_identifiers`` on a 4 KiB prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from rich.console import Console
from rich.table import Table

from prfaas.bench.provenance import provenance
from prfaas.config import from_dict
from prfaas.kv import BlobWriter, KVState, LayerState
from prfaas.kv.fingerprint import Fingerprint
from prfaas.kv.format import state_frames
from prfaas.messages import InstanceInfo
from prfaas.scheduler import Scheduler
from prfaas.store import BlobStore, MemoryBackend
from prfaas.store.sealed import SealedBackend
from prfaas.tenancy import TenantPolicy, metering, redact

MiB = 1 << 20


def kv_frames(mib: int, seed: int) -> tuple[str, list[bytes]]:
    rng = np.random.default_rng(seed)
    layers, tokens = 8, mib * MiB // (8 * 2 * 4 * 64 * 4)
    state = KVState(Fingerprint(model="bench", arch="llama", weights="0" * 16, tokenizer="0" * 16,
                                dtype="float32", max_seq_len=1 << 20), tokens, [
        LayerState(i, "full_attention", True, None, {
            "keys": rng.standard_normal((1, 4, tokens, 64), dtype=np.float32),
            "values": rng.standard_normal((1, 4, tokens, 64), dtype=np.float32)}) for i in range(layers)], 1)
    writer = BlobWriter.for_state(state, chunk_size=MiB)
    return writer.header.kv_id, list(state_frames(writer, state))


def store_round_trips(sealed: bool, blobs: list[tuple[str, list[bytes]]]) -> list[tuple[float, float]]:
    """(write GB/s, read GB/s) of each blob in turn through one store, released after its read (a relay)."""
    inner = MemoryBackend()
    store = BlobStore(8 << 30, 120, backend=SealedBackend(inner, os.urandom(32)) if sealed else inner)
    out = [store_round_trip(store, kv_id, frames) for kv_id, frames in blobs]
    store.close()
    return out


def store_round_trip(store: BlobStore, kv_id: str, frames: list[bytes]) -> tuple[float, float]:
    nbytes = sum(map(len, frames))
    start = time.perf_counter()
    store.create(kv_id, frames[0])
    for frame in frames[1:-1]:
        store.append(kv_id, frame)
    store.finish(kv_id, frames[-1])
    wrote = time.perf_counter() - start

    async def read() -> int:
        return sum([len(f) async for f in store.frames(kv_id, 0, 5.0)])

    start = time.perf_counter()
    assert asyncio.run(read()) == nbytes
    readback = time.perf_counter() - start
    store.release(kv_id)
    return nbytes / wrote / 1e9, nbytes / readback / 1e9


def raw_aes(mib: int) -> tuple[float, float]:
    data, key, nonce = os.urandom(MiB), AESGCM.generate_key(bit_length=256), os.urandom(12)
    aes = AESGCM(key)
    start = time.perf_counter()
    sealed = [aes.encrypt(nonce, data, None) for _ in range(mib)]
    enc = time.perf_counter() - start
    start = time.perf_counter()
    for s in sealed:
        aes.decrypt(nonce, s, None)
    return mib * MiB / enc / 1e9, mib * MiB / (time.perf_counter() - start) / 1e9


def per_call_us(fn: Callable[[], object], n: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def request_path(n: int) -> dict[str, float]:
    usage = metering.RequestUsage("acme", "dc-a", "dc-b", "remote", "ok", 1024, 128, 22 << 20)
    with tempfile.TemporaryDirectory() as folder:
        logged = metering.Meter(str(Path(folder) / "usage.log"))
        out = {"meter_metrics_only_us": per_call_us(lambda: metering.Meter().record(usage), n),
               "meter_with_usage_log_us": per_call_us(lambda: logged.record(usage), n)}
        logged.close()
    scheduler = Scheduler(from_dict({"offload_threshold_tokens": 10}), "relay")
    prefills = [InstanceInfo(f"p{i}", "prefill", "http://x", datacenter="dc-a") for i in range(4)]
    relays = [InstanceInfo("r", "relay", "http://y", datacenter="dc-b")]
    tenant = TenantPolicy("acme", allowed_datacenters=("dc-a", "dc-b"))
    out["route_no_tenant_us"] = per_call_us(lambda: scheduler.route(1000, prefills, relays), n)
    out["route_with_tenant_us"] = per_call_us(lambda: scheduler.route(1000, prefills, relays, tenant, "dc-b"), n)
    prompt = ("Contact jane.doe@example.com or +1 555 010 7788 from 10.0.0.1 about order 4111 1111 1111 1111. "
              + "The quick brown fox jumps over the lazy dog. " * 90)[:4096]
    out["mask_identifiers_4k_us"] = per_call_us(lambda: redact.mask_identifiers(prompt, "acme"), max(1, n // 10))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/tenancy.json")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    blobs = [kv_frames(args.mib, seed) for seed in range(args.repeat + 1)]
    runs = {mode: store_round_trips(mode == "sealed", blobs) for mode in ("plain", "sealed")}
    enc, dec = raw_aes(min(args.mib, 128))
    first = {m: r[0] for m, r in runs.items()}  # a fresh store: every buffer is new memory
    med = {m: (statistics.median(w for w, _ in r[1:]), statistics.median(rd for _, rd in r[1:]))
           for m, r in runs.items()}
    result = {
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "python": platform.python_version()},
        "blob_mib": round(sum(map(len, blobs[0][1])) / MiB, 1), "repeat": args.repeat,
        "store_gbps": {m: {"write": round(w, 3), "read": round(r, 3)} for m, (w, r) in med.items()},
        "first_blob_gbps": {m: {"write": round(w, 3), "read": round(r, 3)} for m, (w, r) in first.items()},
        "aes_gcm_one_core_gbps": {"encrypt": round(enc, 3), "decrypt": round(dec, 3)},
        "request_path_us": {k: round(v, 2) for k, v in request_path(args.calls).items()},
    }
    result["provenance"] = provenance()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    console = Console()
    table = Table(title=f"Encryption at rest: {result['blob_mib']} MiB blobs through a relay's store, one after "
                  f"another (median of blobs 2-{args.repeat + 1}; the first in brackets)")
    for col in ("backend", "write GB/s", "read GB/s"):
        table.add_column(col)
    for mode, (w, r) in med.items():
        table.add_row(mode, f"{w:.2f} ({first[mode][0]:.2f})", f"{r:.2f} ({first[mode][1]:.2f})")
    table.add_row("AES-256-GCM alone", f"{enc:.2f}", f"{dec:.2f}")
    console.print(table)
    costs = Table(title="Request path (µs per request)")
    costs.add_column("step")
    costs.add_column("µs")
    for key, value in result["request_path_us"].items():
        costs.add_row(key, f"{value:.1f}")
    console.print(costs)
    console.print(f"load average {result['machine']['load_avg']}; JSON in {args.out}")


if __name__ == "__main__":
    main()
