"""Selective offload against all-remote and all-local, simulated: no model runs, instances are emulated with
measured speeds (a ``prfaas measure``-style speed profile; default: the PrfaaS paper's Table 5 hybrid).

    .venv/bin/python benchmarks/scheduler.py [--profile docs/examples/paper-table5-profile.json]
        [--prefill 4 --decode 8 --local-slowdown 3 --bandwidth-gbps 100 --requests 4000 --loads 0.5,0.8,1.0,1.3]
        [--out benchmarks/results/scheduler.json]

Model (documented assumptions, also written into the JSON):
- prompt lengths: log-normal μ 9.90, σ 1.00 truncated to 128–128K (the paper's mix); outputs: 256 tokens;
  Poisson arrivals.
- remote prefill: ``--prefill`` instances, FIFO, time from the profile (interpolated per token); the KV streams
  over one shared link while the prefill runs (layer-wise), so only the last chunk — or the backlog when the link
  is the bottleneck — is exposed after the forward pass.
- local prefill: on the decode side, ``--local-slowdown`` × slower per token (less compute-dense hardware), one
  FIFO per decode instance; decode: continuous batching, TPOT = 25 ms + 0.25 ms × batch, ≤ 64 sequences each.
Throughput is completed requests per second of simulated time; TTFT percentiles over all requests.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.bench.provenance import provenance
from prfaas.plan.profile import SpeedProfile
from prfaas.scheduler.speed import PrefillSpeed

OUTPUT_TOKENS, MAX_BATCH = 256, 64
TPOT_BASE_S, TPOT_PER_SEQ_S = 0.025, 0.00025
CHUNK_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Setup:
    speed: PrefillSpeed
    kv_fixed: float
    kv_per_token: float
    prefill: int
    decode: int
    local_slowdown: float
    link_bps: float


def lengths(n: int, rng: random.Random) -> list[int]:
    out = []
    while len(out) < n:
        length = int(math.exp(rng.gauss(9.90, 1.00)))
        if 128 <= length <= 131072:
            out.append(length)
    return out


def simulate(setup: Setup, threshold: float, rate: float, prompts: list[int], rng: random.Random) -> dict:
    remote_free = [0.0] * setup.prefill
    local_free = [0.0] * setup.decode
    link_free, t = 0.0, 0.0
    ends: list[list[float]] = [[] for _ in range(setup.decode)]  # decode finish times per instance
    ttfts, finishes, remote = [], [], 0
    for i, n in enumerate(prompts):
        t += rng.expovariate(rate)
        d = i % setup.decode
        if n > threshold:
            remote += 1
            k = min(range(setup.prefill), key=remote_free.__getitem__)
            start = max(t, remote_free[k])
            done = start + setup.speed.seconds(n)
            remote_free[k] = done
            kv = setup.kv_fixed + setup.kv_per_token * n
            link_start = max(start, link_free)
            link_free = max(link_start + kv * 8 / setup.link_bps, done + CHUNK_BYTES * 8 / setup.link_bps)
            first = link_free
        else:
            start = max(t, local_free[d])
            first = start + setup.speed.seconds(n) * setup.local_slowdown
            local_free[d] = first
        first = _decode_slot(ends[d], first)
        batch = sum(1 for e in ends[d] if e > first)
        finish = first + OUTPUT_TOKENS * (TPOT_BASE_S + TPOT_PER_SEQ_S * batch)
        heapq.heappush(ends[d], finish)
        ttfts.append(first - t)
        finishes.append(finish)
    span = max(finishes) - 0.0
    ttfts.sort()
    return {"throughput_rps": len(prompts) / span, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[int(0.99 * (len(ttfts) - 1))], "offload_fraction": remote / len(prompts)}


def _decode_slot(ends: list[float], ready: float) -> float:
    """A decode instance holds at most MAX_BATCH sequences: wait for a slot if it is full."""
    while ends and ends[0] <= ready:
        heapq.heappop(ends)
    if len(ends) < MAX_BATCH:
        return ready
    return max(ready, heapq.heappop(ends))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="docs/examples/paper-table5-profile.json")
    parser.add_argument("--prefill", type=int, default=4)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--local-slowdown", type=float, default=3.0)
    parser.add_argument("--bandwidth-gbps", type=float, default=100.0)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--loads", default="0.5,0.8,1.0,1.3")
    parser.add_argument("--out", default="benchmarks/results/scheduler.json")
    args = parser.parse_args()
    profile = SpeedProfile.from_file(args.profile)
    kv = profile.kv_points("none")
    per_token = (kv[-1][1] - kv[0][1]) / (kv[-1][0] - kv[0][0])
    setup = Setup(PrefillSpeed(list(profile.prefill)), kv[0][1] - per_token * kv[0][0],
                  per_token, args.prefill, args.decode, args.local_slowdown, args.bandwidth_gbps * 1e9)
    rng = random.Random(0)
    prompts = lengths(args.requests, rng)
    base = simulate(setup, 0, 1e9, prompts, random.Random(1))["throughput_rps"]  # all-remote capacity probe
    policies = {"all-local": math.inf, "all-remote": 0.0}
    policies.update({f"selective t={t // 1024}K": t for t in (4096, 16384, 32768, 65536)})
    rows = []
    for load in (float(x) for x in args.loads.split(",")):
        for name, threshold in policies.items():
            r = simulate(setup, threshold, base * load, prompts, random.Random(2))
            rows.append({"load": load, "arrival_rps": base * load, "policy": name, "threshold": threshold, **r})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"provenance": provenance(), "setup": vars(args),
                                          "all_remote_capacity_rps": base, "rows": rows},
                                         indent=2, default=str))
    table = Table(title=f"simulated cluster: {args.prefill} remote prefill, {args.decode} decode, "
                        f"{args.bandwidth_gbps:g} Gbps, local prefill {args.local_slowdown:g}x slower")
    for col in ("load", "policy", "offload", "throughput req/s", "TTFT P50 s", "TTFT P99 s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['load']:.1f}", r["policy"], f"{r['offload_fraction']:.0%}", f"{r['throughput_rps']:.2f}",
                      f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p99_s']:.2f}")
    Console().print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
