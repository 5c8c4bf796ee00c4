"""Link verdict: the Ethernet rules (docs/planning.md) applied to a KV curve, a prompt-length mix and a link.

Rules (each reported with value, limit and margin):
- ``bandwidth``: peak KV throughput (QPS × mean KV bytes × 8) ≤ 70 % of the available bandwidth;
- ``rtt``: RTT P99 ≤ 20 % of the TTFT budget;
- ``loss``: loss ≤ 0.1 %;
- ``transfer_p99``: the P99-length prompt's transfer (RTT P99 + jitter + bytes over the bandwidth left by the
  average load, i.e. ``bandwidth × (1 − ρ)``) ≤ ``transfer_share`` (10–20 %, default 15 %) of the
  end-to-end budget.
  It ignores the overlap of transfer with prefill (layer-wise streaming), so it errs on the safe side.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prfaas.errors import InvalidRequest
from prfaas.plan.kvcurve import KVCurve
from prfaas.plan.lengths import LengthDist

BANDWIDTH_SHARE = 0.70
RTT_SHARE = 0.20
MAX_LOSS = 0.001


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_bps: float
    rtt_p50_ms: float
    rtt_p99_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0
    mtu: int = 1500
    source: str = "flags"

    @staticmethod
    def from_json(data: dict[str, Any], source: str = "file") -> LinkSpec:
        """Reads ``prfaas probe run --json`` output (or any object with the same keys)."""
        try:
            p50 = float(data["rtt_p50_ms"])
            return LinkSpec(float(data["bandwidth_bps"]), p50, float(data.get("rtt_p99_ms", p50)),
                            float(data.get("jitter_ms", 0.0)), float(data.get("loss", 0.0)),
                            int(data.get("mtu", 1500)), source)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"link file {source}: needs bandwidth_bps and rtt_p50_ms ({exc})") from exc

    @staticmethod
    def from_file(path: str | Path) -> LinkSpec:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidRequest(f"cannot read link file {path}: {exc}") from exc
        return LinkSpec.from_json(data, str(path))


@dataclass(frozen=True)
class Budget:
    qps: float
    ttft_ms: float
    e2e_ms: float
    transfer_share: float = 0.15


@dataclass(frozen=True)
class Check:
    rule: str
    ok: bool
    value: float
    limit: float
    unit: str
    margin: float  # limit - value, in unit (positive = headroom)
    reason: str


def transfer_ms(nbytes: int, link: LinkSpec, load_bps: float) -> float:
    """Time to move one blob: RTT P99 + jitter + bytes over the bandwidth the background load leaves."""
    free = link.bandwidth_bps - load_bps
    if free <= 0:
        return math.inf
    return link.rtt_p99_ms + link.jitter_ms + nbytes * 8 / free * 1e3


def _check(rule: str, value: float, limit: float, unit: str, what: str) -> Check:
    ok = value <= limit
    sign = "≤" if ok else ">"
    reason = f"{what}: {value:.4g} {unit} {sign} {limit:.4g} {unit}"
    return Check(rule, ok, value, limit, unit, limit - value, reason)


def evaluate(curve: KVCurve, mix: LengthDist, link: LinkSpec, budget: Budget) -> list[Check]:
    mean_bytes = sum(w * curve.kv_bytes(n) for n, w in zip(mix.lengths, mix.weights, strict=True))
    demand = budget.qps * mean_bytes * 8
    p99_len = mix.quantile(0.99)
    t99 = transfer_ms(curve.kv_bytes(p99_len), link, demand)
    return [
        _check("bandwidth", demand / 1e9, BANDWIDTH_SHARE * link.bandwidth_bps / 1e9, "Gbps",
               f"peak KV throughput at {budget.qps:g} QPS vs 70% of {link.bandwidth_bps / 1e9:.3g} Gbps"),
        _check("rtt", link.rtt_p99_ms, RTT_SHARE * budget.ttft_ms, "ms",
               f"RTT P99 vs 20% of the {budget.ttft_ms:g} ms TTFT budget"),
        _check("loss", link.loss * 100, MAX_LOSS * 100, "%", "packet loss vs 0.1%"),
        _check("transfer_p99", t99, budget.transfer_share * budget.e2e_ms, "ms",
               f"transfer of a P99 prompt ({p99_len} tokens) vs {budget.transfer_share:.0%} of the "
               f"{budget.e2e_ms:g} ms end-to-end budget"),
    ]


def largest_fitting_length(curve: KVCurve, link: LinkSpec, budget: Budget, max_len: int = 1 << 21) -> int:
    """The longest prompt length whose traffic alone passes every length-dependent rule."""
    def fits(n: int) -> bool:
        checks = evaluate(curve, LengthDist((n,), (1.0,)), link, budget)
        return all(c.ok for c in checks if c.rule in ("bandwidth", "transfer_p99"))

    if not fits(1):
        return 0
    lo, hi = 1, max_len
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def verdict_json(checks: list[Check], largest: int, settings: dict[str, Any],
                 advice: list[str]) -> dict[str, Any]:
    ok = all(c.ok for c in checks)
    tight = [c.rule for c in checks if c.ok and c.limit > 0 and c.margin / c.limit < 0.2]
    verdict = "feasible" if ok and not tight else "marginal" if ok else "not feasible"
    rows = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(c).items()}
            for c in checks]  # JSON has no infinity: an impossible transfer is null
    return {"verdict": verdict, "ok": ok, "checks": rows,
            "failed": [c.rule for c in checks if not c.ok], "tight": tight,
            "largest_prompt_tokens": largest, "recommended": settings, "advice": advice}
