"""Two client clusters of one prefill pool, each on its own link of the three-datacenter lab, real model.

    .venv/bin/python benchmarks/lab_clusters.py [--requests 20] [--lengths 256,512,1024]
                                                [--fair-requests 12] [--fair-length 512] [--burst 10]

Builds its own three-datacenter lab (``Topology.numbered(LAB_INDEX)``, so a lab someone has up is not touched:
the pool's datacenter and two decode datacenters, the first on a 10 Gbit / 5 ms RTT link, the second on 1 Gbit /
25 ms RTT), measures each link with ``prfaas probe`` (what the lab delivers, not what was asked), then runs
``prfaas up --lab --lab-index LAB_INDEX --clusters 2`` (SmolLM2-135M: one prefill instance shared by both
clusters, each cluster's router, relay and decode in its own datacenter) and sends both clusters the same mix of
prompt lengths at the same time, one request at a time per cluster. Records TTFT P50/P99 per cluster as the
client sees it (first streamed token) and as the router reports it, the routes taken, the KV bytes each cluster's
requests moved, and the bytes each link carried (dc-a's end of its WAN veth, both directions: KV plus control
traffic).

Then the fair-share figure, in two phases of the same deployment: cluster 1 sends ``--fair-requests`` prompts of
``--fair-length`` tokens one at a time while cluster 0 keeps one request in flight (its share: the same as
cluster 1's; the baseline), then while cluster 0 keeps ``--burst`` requests in flight (10x its share). The figure
is cluster 1's remote TTFT P99 in the burst against its baseline, and its pool TTFT (the prefill instance's queue
wait + prefill, the part another cluster shares: the transfer and the restore use cluster 1's own link and decode
instance) likewise; cluster 0's completed requests per second show the burst it actually made.

Writes ``benchmarks/results/lab_clusters.json`` and prints a table. Needs root. The host's CPUs are shared by
every process of the run (both clusters' decode instances and the pool's prefill) and by whatever else runs on
this machine: the load average is recorded with the figures, and a burst also takes CPU from the other cluster's
decode instance, which separate hosts would not.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from prfaas.bench.background import start_up, stop_up
from prfaas.bench.client import RequestRecord, request_body, send
from prfaas.bench.provenance import provenance
from prfaas.bench.stats import percentile
from prfaas.lab import Lab, LinkSettings, Topology
from prfaas.lab.system import namespaces, run
from prfaas.lab.topology import TCP_BUFFERS

MODEL = "smollm2-135m"
VOCAB = 49_152  # SmolLM2's vocabulary: random token ids make prompts that share no prefix
LAB_INDEX = 13  # prfaas.lab Topology.numbered: clear of `prfaas lab` (dc-a/dc-b), the tests' and other benchmarks'
TOPO = Topology.numbered(LAB_INDEX, decode_dcs=2)
LINKS = {TOPO.wires[0].name: LinkSettings(rate="10gbit", delay_ms=2.5),
         TOPO.wires[1].name: LinkSettings(rate="1gbit", delay_ms=12.5)}
PROBE_PORT = 5298
ROUTER_PORT = 8410
THRESHOLD = 64  # every prompt of the mix is over it: remote unless the router decides otherwise


def probe_link(lab: Lab, name: str) -> dict[str, Any]:
    """``prfaas probe`` from dc-a to the decode datacenter of link ``name`` (one stream, 4 s)."""
    wire = TOPO.wire(name)
    prfaas = [sys.executable, "-m", "prfaas", "probe"]
    server = subprocess.Popen(lab.exec_argv(wire.ns, [*prfaas, "serve", "--port", str(PROBE_PORT), "--host",
                                                      wire.wan_b, "--duration", "120s"]), stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        done = subprocess.run(lab.exec_argv(TOPO.ns_a, [*prfaas, "run", f"{wire.wan_b}:{PROBE_PORT}", "--streams",
                                                        "1", "--duration", "4s", "--json"]),
                              capture_output=True, text=True, timeout=120, check=True)
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        server.kill()
        server.wait()


def wan_bytes() -> dict[str, int]:
    """Bytes each link has carried so far, both directions, at dc-a's end."""
    out = {}
    for wire in TOPO.wires:
        stats = f"/sys/class/net/{wire.wan_if}/statistics"
        rx, tx = run(["cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes"], ns=TOPO.ns_a).split()
        out[wire.name] = int(rx) + int(tx)
    return out


async def cluster_run(url: str, lengths: list[int], seed: int) -> list[RequestRecord]:
    """One request at a time, the lengths in order; prompts of random token ids (no shared prefix)."""
    rng = random.Random(seed)
    records = []
    async with httpx.AsyncClient() as client:
        for length in lengths:
            body = request_body(MODEL, [rng.randrange(VOCAB) for _ in range(length)], max_tokens=8)
            records.append(await send(client, url, body, epoch=0.0, timeout_s=300))
    return records


async def both(urls: list[str], lengths: list[int]) -> list[list[RequestRecord]]:
    return list(await asyncio.gather(*(cluster_run(url, lengths, seed) for seed, url in enumerate(urls))))


async def keep_busy(url: str, length: int, seed: int, stop: asyncio.Event) -> list[RequestRecord]:
    """One request after another until ``stop`` (the one in flight then ends first)."""
    rng, records = random.Random(seed), []
    async with httpx.AsyncClient() as client:
        while not stop.is_set():
            body = request_body(MODEL, [rng.randrange(VOCAB) for _ in range(length)], max_tokens=8)
            records.append(await send(client, url, body, epoch=0.0, timeout_s=300))
    return records


async def fair_phase(urls: list[str], length: int, requests: int, streams: int, seed: int
                     ) -> tuple[list[RequestRecord], list[RequestRecord], float]:
    """Cluster 1's ``requests`` prompts, one at a time, while cluster 0 keeps ``streams`` requests in flight;
    returns (cluster 1's records, cluster 0's, the phase's seconds). Cluster 1 starts once cluster 0's requests
    are under way, so every one of its prompts meets them."""
    stop = asyncio.Event()
    began = time.perf_counter()
    load = [asyncio.create_task(keep_busy(urls[0], length, seed * 1000 + i, stop)) for i in range(streams)]
    await asyncio.sleep(2.0)
    measured = await cluster_run(urls[1], [length] * requests, seed)
    stop.set()
    other = [r for records in await asyncio.gather(*load) for r in records]
    return measured, other, time.perf_counter() - began


def fair_row(phase: str, streams: int, measured: list[RequestRecord], other: list[RequestRecord],
             wall_s: float) -> dict[str, Any]:
    row = summary("cluster-1", TOPO.wires[1].name, measured)
    remote = [r for r in measured if r.ok and r.prfaas.get("route") == "remote"]
    pool_s = [q + p for q, p in zip(_stage(remote, "queue_ms"), _stage(remote, "prefill_ms"), strict=True)]
    return {"phase": phase, "cluster_0_in_flight": streams,
            "cluster_0_requests_per_s": round(sum(r.ok for r in other) / wall_s, 3),
            "cluster_0_failed": sum(not r.ok for r in other), "requests": row["requests"], "failed": row["failed"],
            "remote": row["remote"], "ttft_p50_ms": row["ttft_p50_ms"], "ttft_p99_ms": row["ttft_p99_ms"],
            "pool_ttft_p50_ms": _ms(pool_s, 50), "pool_ttft_p99_ms": _ms(pool_s, 99),
            "queue_p99_ms": _ms(_stage(remote, "queue_ms"), 99), "prefill_p50_ms": row["prefill_p50_ms"],
            "transfer_p50_ms": row["transfer_p50_ms"], "wall_s": round(wall_s, 1)}


def fair_share(urls: list[str], length: int, requests: int, burst: int) -> dict[str, Any]:
    """The two phases and the figure: cluster 1's TTFT P99 (remote, and in the pool) in the burst over its
    baseline."""
    rows = [fair_row(phase, streams, *asyncio.run(fair_phase(urls, length, requests, streams, seed)))
            for seed, (phase, streams) in enumerate((("baseline", 1), ("burst", burst)), start=7)]
    base, hit = rows

    def ratio(key: str) -> float | None:
        return round(hit[key] / base[key], 3) if base.get(key) and hit.get(key) is not None else None

    return {"length": length, "requests": requests, "burst_in_flight": burst, "rows": rows,
            "ttft_p99_ratio": ratio("ttft_p99_ms"), "pool_ttft_p99_ratio": ratio("pool_ttft_p99_ms"),
            "loadavg_after": [round(x, 2) for x in provenance()["machine"]["load_average"]]}  # type: ignore[index]


def _ms(seconds: list[float], q: float) -> float | None:
    found = percentile(seconds, q)
    return None if found is None else round(found * 1e3, 1)


def _stage(records: list[RequestRecord], key: str) -> list[float]:
    """One stage of the remote requests' ``prfaas.stages`` (transfer, queue, prefill), in seconds."""
    stages = (r.prfaas.get("stages") or {} for r in records)
    return [float(s[key]) / 1e3 for s in stages if s.get(key) is not None]


def summary(name: str, link: str, records: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    client_s = [r.ttft_s for r in ok if r.ttft_s is not None]
    router_s = [float(r.prfaas["ttft_ms"]) / 1e3 for r in ok if r.prfaas.get("ttft_ms") is not None]
    remote = [r for r in ok if r.prfaas.get("route") == "remote"]
    transfer_s, queue_s, prefill_s = (_stage(remote, key) for key in ("transfer_ms", "queue_ms", "prefill_ms"))
    local_why = collections.Counter(str(r.prfaas.get("reason_code")) for r in ok if r.prfaas.get("route") != "remote")
    return {"cluster": name, "link": link, "requests": len(records), "failed": len(records) - len(ok),
            "remote": len(remote), "local": len(ok) - len(remote),
            "ttft_p50_ms": _ms(client_s, 50), "ttft_p99_ms": _ms(client_s, 99),
            "router_ttft_p50_ms": _ms(router_s, 50), "router_ttft_p99_ms": _ms(router_s, 99),
            "queue_p50_ms": _ms(queue_s, 50), "prefill_p50_ms": _ms(prefill_s, 50),
            "transfer_p50_ms": _ms(transfer_s, 50),
            "local_reasons": ", ".join(f"{why} {n}" for why, n in sorted(local_why.items())),
            "kv_bytes": sum(int(r.prfaas.get("kv_bytes") or 0) for r in remote),
            "prefill_instances": sorted({str(r.prfaas.get("prefill_instance")) for r in remote})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=24, help="requests per cluster")
    parser.add_argument("--lengths", default="256,512,1024", help="prompt lengths, cycled")
    parser.add_argument("--fair-requests", type=int, default=12, help="cluster 1's prompts per fair-share phase")
    parser.add_argument("--fair-length", type=int, default=512, help="prompt length of the fair-share phases")
    parser.add_argument("--burst", type=int, default=10, help="cluster 0's requests in flight in the burst")
    args = parser.parse_args()
    if any(ns in namespaces() for ns in TOPO.namespaces):
        raise SystemExit(f"the lab {', '.join(TOPO.namespaces)} is up: `Lab(topo=Topology.numbered({LAB_INDEX}, "
                         "decode_dcs=2)).down()` first")
    mix = [int(n) for n in args.lengths.split(",")]
    lengths = [mix[i % len(mix)] for i in range(args.requests)]
    with Lab(topo=TOPO, links=LINKS) as lab:
        probes = {name: probe_link(lab, name) for name in LINKS}
        proc = start_up(["--lab", "--lab-index", str(LAB_INDEX), "--clusters", "2", "--model", MODEL, "--port",
                         str(ROUTER_PORT), "--offload-threshold", str(THRESHOLD)])
        try:
            urls = [f"http://{wire.public}:{ROUTER_PORT + i}" for i, wire in enumerate(TOPO.wires)]
            asyncio.run(both(urls, [mix[0]] * 2))  # warm-up: first requests load caches and open connections
            before, began = wan_bytes(), time.perf_counter()
            loadavg_before = list(provenance()["machine"]["load_average"])  # type: ignore[index]
            results = asyncio.run(both(urls, lengths))
            wall_s, after = time.perf_counter() - began, wan_bytes()
            fair = fair_share(urls, args.fair_length, args.fair_requests, args.burst)
        finally:
            stop_up(proc)
    clusters = [summary(f"cluster-{i}", wire.name, records) for i, (wire, records) in
                enumerate(zip(TOPO.wires, results, strict=True))]
    links: list[dict[str, Any]] = [{"link": name, "rate_asked": asked.rate, "rtt_asked_ms": 2 * asked.delay_ms,
              "bandwidth_measured_bps": probes[name].get("bandwidth_bps"),
              "rtt_measured_p50_ms": probes[name].get("rtt_p50_ms"),
              "rtt_measured_p99_ms": probes[name].get("rtt_p99_ms"),
              "wan_bytes_during_run": after[name] - before[name]} for name, asked in LINKS.items()]
    report = {"provenance": provenance(), "model": MODEL, "offload_threshold": THRESHOLD, "lengths": lengths,
              "max_tokens": 8, "wall_s": round(wall_s, 1), "loadavg_before": loadavg_before,
              "tcp_buffers": TCP_BUFFERS, "links": links, "clusters": clusters, "fair_share_rows": fair.pop("rows"),
              "fair_share": fair,
              "notes": ["one prefill instance (dc-a) serves both clusters; each cluster sends one request at a time",
                        "the delay is a user-space delay line (no netem here), one process per delayed link: "
                        "the probe's bandwidth is what a link delivered, which can be less than it was asked",
                        "transfer_p50_ms is the router's transfer stage: it starts when prefill accepts the "
                        "request, so it includes the wait behind the other cluster's prefills",
                        "fair_share: cluster 1 one request at a time while cluster 0 keeps 1 (baseline) or "
                        "--burst (10x its share) in flight; pool TTFT = the prefill instance's queue + prefill"]}
    out = Path(__file__).resolve().parent / "results" / "lab_clusters.json"
    out.write_text(json.dumps(report, indent=1))
    for link in links:
        print(f"{link['link']:10} asked {link['rate_asked']:>7} RTT {link['rtt_asked_ms']:5.1f} ms   measured "
              f"{(link['bandwidth_measured_bps'] or 0) / 1e9:5.2f} Gbit/s RTT p50 {link['rtt_measured_p50_ms']} ms"
              f"   carried {link['wan_bytes_during_run'] / 2**20:8.1f} MiB")
    for row in clusters:
        print(f"{row['cluster']:10} {row['link']:10} remote {row['remote']:3} local {row['local']:3} failed "
              f"{row['failed']:2}  TTFT p50 {row['ttft_p50_ms']} ms p99 {row['ttft_p99_ms']} ms  KV "
              f"{row['kv_bytes'] / 2**20:7.1f} MiB")
    for row in report["fair_share_rows"]:
        print(f"fair share {row['phase']:8} cluster 0 in flight {row['cluster_0_in_flight']:2} "
              f"({row['cluster_0_requests_per_s']} req/s): cluster 1 TTFT p50 {row['ttft_p50_ms']} p99 "
              f"{row['ttft_p99_ms']} ms, pool p99 {row['pool_ttft_p99_ms']} ms")
    print(f"cluster 1's TTFT P99 under the burst / baseline: {fair['ttft_p99_ratio']} (pool: "
          f"{fair['pool_ttft_p99_ratio']})")


if __name__ == "__main__":
    main()
