"""What to change when a rule fails, and the transfer settings a link calls for."""

from __future__ import annotations

import math
from typing import Any

from prfaas.plan.kvcurve import KVCurve
from prfaas.plan.lengths import LengthDist
from prfaas.plan.link import BANDWIDTH_SHARE, Budget, Check, LinkSpec, transfer_ms

MIB = 1 << 20
TCP_IP_OVERHEAD = 52  # IPv4 20 + TCP 20 + timestamps 12


def recommend(curve: KVCurve, mix: LengthDist, link: LinkSpec, budget: Budget) -> dict[str, Any]:
    """Chunk size from MTU and bandwidth-delay product, timeouts from RTT, retries, in-flight limit."""
    bdp = link.bandwidth_bps / 8 * link.rtt_p50_ms / 1e3
    streams = 1 if bdp <= 4 * MIB else 2 if bdp <= 16 * MIB else 4 if bdp <= 64 * MIB else 8
    per_stream = bdp / streams
    chunk = min(max(1 << max(0, math.ceil(math.log2(max(per_stream, 1)))), MIB), 8 * MIB)
    mss = link.mtu - TCP_IP_OVERHEAD
    chunk_ms = chunk * 8 / link.bandwidth_bps * 1e3 * streams
    timeout = max(50, math.ceil(2 * link.rtt_p99_ms + 3 * link.jitter_ms + 3 * chunk_ms))
    degrade = max(50, math.ceil(1.5 * (link.rtt_p99_ms + chunk_ms)))
    mean_bytes = sum(w * curve.kv_bytes(n) for n, w in zip(mix.lengths, mix.weights, strict=True))
    mean_t = transfer_ms(int(mean_bytes), link, budget.qps * mean_bytes * 8) / 1e3
    inflight = 4 if not math.isfinite(mean_t) else min(max(4, math.ceil(2 * budget.qps * mean_t)), 1024)
    biggest = curve.kv_bytes(mix.lengths[-1])
    chunks = math.ceil(biggest / chunk)
    deadline = chunks * chunk * 8 / link.bandwidth_bps * 1e3 + timeout
    return {
        "chunk_size_kb": chunk // 1024, "packets_per_chunk": math.ceil(chunk / max(mss, 1)),
        "transfer_streams": streams, "bdp_bytes": round(bdp),
        "kv_transfer_timeout_ms": timeout, "degrade_p99_ms": degrade,
        "kv_retry_budget": 2 if link.loss <= 0.001 else 1, "max_inflight_kv": inflight,
        "largest_blob_deadline_ms": round(deadline, 1),
    }


def advise(checks: list[Check], curve: KVCurve, mix: LengthDist, link: LinkSpec, budget: Budget,
           largest: int) -> list[str]:
    out: list[str] = []
    failed = {c.rule: c for c in checks if not c.ok}
    if "bandwidth" in failed:
        need = failed["bandwidth"].value / BANDWIDTH_SHARE
        out.append(f"bandwidth: the mix needs a link of ≥ {need:.3g} Gbps (at 70% utilisation); a codec "
                   f"halving the KV (fp8 from bf16) needs {need / 2:.3g} Gbps, int4 {need / 4:.3g} Gbps; "
                   f"or offload only prompts that fit (raise offload_threshold_tokens), or lower the QPS")
    if "rtt" in failed:
        out.append(f"rtt: RTT P99 {link.rtt_p99_ms:g} ms needs a TTFT budget ≥ {link.rtt_p99_ms / 0.2:g} ms; "
                   f"otherwise place prefill nearer to decode or keep such requests local")
    if "loss" in failed:
        out.append(f"loss: {link.loss:.3%} loss makes TCP throughput collapse; fix the path or use a "
                   f"dedicated link before offloading KV over it")
    if "transfer_p99" in failed:
        out.append(f"transfer_p99: prompts above {largest} tokens miss the transfer budget on this link; set "
                   f"offload_threshold_tokens no higher than the share that fits, compress the KV, or raise "
                   f"the end-to-end budget")
    if not out:
        out.append("all rules pass; re-run the probe at peak hours and keep degrade_p99_ms as recommended")
    return out
