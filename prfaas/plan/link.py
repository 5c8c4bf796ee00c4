"""Link verdict: the Ethernet rules (docs/planning.md) applied to a KV curve, a prompt-length mix and a link.

Rules (each reported with value, limit and margin):
- ``bandwidth``: peak KV throughput (QPS × mean KV bytes × 8) ≤ 70 % of the available bandwidth;
- ``rtt``: RTT P99 ≤ 20 % of the TTFT budget;
- ``loss``: loss ≤ 0.1 %;
- ``transfer_p99``: the P99-length prompt's transfer over a fresh connection, as the data plane moves a blob
  (``prfaas.plan.transfer.wire_ms``: handshake, slow-start rounds at RTT P50, then bytes over the bandwidth left
  by the average load, i.e. ``bandwidth × (1 − ρ)``; plus the tail, RTT P99 − P50 and jitter, paid once)
  ≤ ``transfer_share`` (10–20 %, default 15 %) of the end-to-end budget.
  It ignores the overlap of transfer with prefill (layer-wise streaming), so it errs on the safe side.

``transfer_json`` adds what the serving path will show at that load: the ``transfer_ms`` stage and its exposed
part for each length of the mix, at its P50 and P99 lengths, and as P50 and P99 over the mix (the P99s with the
tail), in relay or direct mode, with the prefill and encoding times of a speed profile when one is given
(``prfaas.plan.transfer``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prfaas.errors import InvalidRequest
from prfaas.plan.kvcurve import KVCurve
from prfaas.plan.lengths import LengthDist
from prfaas.plan.transfer import Transfer, predict, wire_ms

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


def tail_ms(link: LinkSpec) -> float:
    """What a P99 transfer adds to a typical one: one round trip at RTT P99 instead of P50, and the jitter. Once,
    not on every slow-start round: a P99 round trip (a retransmission, a busy host) is rare by definition, and
    on a lossy lab link the probe's P99 was 4-6 times the P50 while a 155 MB blob took 8 % longer."""
    return max(0.0, link.rtt_p99_ms - link.rtt_p50_ms) + link.jitter_ms


def transfer_ms(nbytes: int, link: LinkSpec, load_bps: float) -> float:
    """Time to move one blob over a fresh connection (handshake and slow start at RTT P50:
    ``prfaas.plan.transfer.wire_ms``) at the bandwidth the background load leaves, plus the P99 tail."""
    free = link.bandwidth_bps - load_bps
    if free <= 0:
        return math.inf
    return wire_ms(nbytes, free, link.rtt_p50_ms, link.mtu) + tail_ms(link)


def transfer_json(curve: KVCurve, mix: LengthDist, link: LinkSpec, load_bps: float,
                  prefill_ms: Callable[[int], float] | None = None, encode_ms: Callable[[int], float] | None = None,
                  mode: str = "relay") -> dict[str, Any]:
    """The serving path's predicted transfer stage and exposed transfer (ms) in ``mode`` per length of ``mix``, at
    its P50 and P99 lengths, and their P50 and P99 over the mix (``over_mix``: what a run of the mix measures; a
    short prompt can expose more than the P99 one, having less prefill to hide behind), at the bandwidth
    ``load_bps`` leaves; ``prefill_ms`` and ``encode_ms`` (a speed profile's) let the stream overlap the forward
    pass, without them nothing overlaps. Null where the link is saturated."""
    free = link.bandwidth_bps - load_bps
    compute, encode = prefill_ms or (lambda n: 0.0), encode_ms or (lambda n: 0.0)

    def one(n: int, tail: float = 0.0) -> dict[str, Any]:
        t: Transfer = predict(n, curve.kv_bytes(n), compute(n), free, link.rtt_p50_ms, link.mtu,
                              encode_ms=encode(n), mode=mode)
        row = {"seq_len": n, "kv_bytes": t.kv_bytes, "prefill_ms": t.prefill_ms, "encode_ms": t.encode_ms,
               "instance_prefill_ms": t.instance_prefill_ms, "wire_ms": t.wire_ms + tail,
               "stage_ms": t.stage_ms + tail, "exposed_ms": t.exposed_ms + tail}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}

    rows, tail = [one(n) for n in mix.lengths], tail_ms(link)

    def over_mix(key: str, q: float, extra: float = 0.0) -> float | None:
        values = [row[key] for row in rows]
        return None if any(v is None for v in values) else mix.quantile_of(values, q) + extra

    quantiles = {"stage_p50_ms": over_mix("stage_ms", 0.5), "stage_p99_ms": over_mix("stage_ms", 0.99, tail),
                 "exposed_p50_ms": over_mix("exposed_ms", 0.5), "exposed_p99_ms": over_mix("exposed_ms", 0.99, tail)}
    return {"per_length": rows, "p50": one(mix.quantile(0.5)), "p99": one(mix.quantile(0.99), tail),
            "over_mix": quantiles, "mode": mode, "free_bandwidth_bps": max(0.0, free),
            "overlap": prefill_ms is not None}


def _check(rule: str, value: float, limit: float, unit: str, what: str) -> Check:
    ok = value <= limit
    sign = "≤" if ok else ">"
    reason = f"{what}: {value:.4g} {unit} {sign} {limit:.4g} {unit}"
    return Check(rule, ok, value, limit, unit, limit - value, reason)


def demand_bps(curve: KVCurve, mix: LengthDist, qps: float) -> float:
    """The mix's KV traffic at ``qps``: QPS × mean KV bytes × 8."""
    return qps * sum(w * curve.kv_bytes(n) for n, w in zip(mix.lengths, mix.weights, strict=True)) * 8


def evaluate(curve: KVCurve, mix: LengthDist, link: LinkSpec, budget: Budget) -> list[Check]:
    demand = demand_bps(curve, mix, budget.qps)
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


def recheck(checks: list[Check], values: dict[str, float]) -> list[Check]:
    """The same rules and limits with the values of ``values`` (by rule) in place of the predicted ones: a
    verdict on what was measured."""
    return [_check(c.rule, values[c.rule], c.limit, c.unit, c.reason.split(": ", 1)[0]) if c.rule in values else c
            for c in checks]


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
