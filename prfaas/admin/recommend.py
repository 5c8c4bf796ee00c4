"""``prfaas admin recommend``: the planner's capacity model fed with live numbers.

Input: the router's signals (arrival rate, prompt-length distribution, output length, offload fraction, queue
waits, KV egress) and a speed profile (``prfaas measure``). For every candidate offload threshold ``t`` it sizes
the pools to run at ``target_utilisation``:

    prefill = ⌈λ·p·E[T_prefill(l) | l > t] / u⌉
    decode  = ⌈(λ·(1−p)·E[T_prefill(l) | l ≤ t] + λ·out·TPOT(b)/b) / u⌉      (short prompts prefill on decode)

and drops a threshold whose KV egress λ·p·E[8·KV(l) | l > t] exceeds ``link_share`` of the link, or that leaves
decode instances prefills longer than ``local_prefill_budget_s`` (a long local prefill stalls every stream on that
instance: the interference disaggregation exists to remove). The answer is the threshold with the fewest instances
(ties: less egress). Pure function; ``InvalidRequest`` when there is no
traffic in the window or the profile lacks prefill timings.

A prefill pool shared by several client clusters (docs/pool.md) is sized from the sum of its clients' demand:
``combine`` merges the signals of every cluster's router into one (the decode figure is then the clusters'
total, each cluster sizing its own share of it; the egress check is the pool's total egress against ``link_bps``,
the pool's uplink).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from prfaas.errors import InvalidRequest
from prfaas.plan.lengths import LengthDist
from prfaas.plan.profile import SpeedProfile, interpolate


@dataclass(frozen=True)
class Advice:
    offload_threshold_tokens: int
    prefill_instances: int
    decode_instances: int
    offload_fraction: float
    kv_egress_bps: float
    link_utilisation: float
    reasons: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "reasons": list(self.reasons)}


def recommend(signals: dict[str, Any], profile: SpeedProfile, link_bps: float, link_share: float = 0.7,
              target_utilisation: float = 0.7, local_prefill_budget_s: float = 0.5) -> Advice:
    rate = float(signals.get("arrival_rps", 0.0))
    lengths = {int(k): float(v) for k, v in (signals.get("prompt_lengths") or {}).items()}
    if rate <= 0 or not lengths:
        raise InvalidRequest("no finished requests in the signals' window: nothing to size the pools from")
    dist = LengthDist.of(lengths, "router signals")
    out_tokens = max(1.0, float(signals.get("mean_output_tokens", 1.0)))
    decode_s = _decode_seconds_per_request(profile, out_tokens)
    kv = _kv_bytes(profile, signals)
    options = [_size(dist, t, rate, profile, decode_s, kv, link_bps, target_utilisation)
               for t in (0, *dist.lengths) if t == 0 or profile.prefill_seconds(t) <= local_prefill_budget_s]
    feasible = [o for o in options if o["egress"] <= link_share * link_bps] or [min(options, key=lambda o: o["egress"])]
    best = min(feasible, key=lambda o: (o["prefill"] + o["decode"], o["egress"]))
    return Advice(best["t"], best["prefill"], best["decode"], round(best["p"], 4), best["egress"],
                  round(best["egress"] / link_bps, 4) if link_bps else 0.0,
                  tuple(_reasons(signals, best, link_bps * link_share)))


def combine(clients: list[dict[str, Any]]) -> dict[str, Any]:
    """One pool's signals from the signals of each client cluster's router: demand adds up (arrivals, prompt
    lengths, KV egress, decode instances and their queues), the prefill instances are the same ones seen by
    every router (the largest count), rates and means are weighted by each cluster's requests."""
    if len(clients) == 1:
        return clients[0]
    requests = [float(c.get("requests", 0)) for c in clients]
    total = sum(requests) or 1.0
    lengths: dict[str, float] = {}
    for client in clients:
        for length, count in (client.get("prompt_lengths") or {}).items():
            lengths[length] = lengths.get(length, 0.0) + float(count)
    return {
        "window_s": max(float(c.get("window_s", 0)) for c in clients), "requests": int(sum(requests)),
        "arrival_rps": sum(float(c.get("arrival_rps", 0)) for c in clients),
        "offload_fraction": sum(float(c.get("offload_fraction", 0)) * n for c, n in zip(clients, requests,
                                                                                         strict=True)) / total,
        "prefill_queue_wait_s": max(float(c.get("prefill_queue_wait_s", 0)) for c in clients),
        "decode_queue_depth": sum(int(c.get("decode_queue_depth", 0)) for c in clients),
        "decode_free_kv_bytes": sum(int(c.get("decode_free_kv_bytes", 0)) for c in clients),
        "kv_egress_bps": sum(float(c.get("kv_egress_bps", 0)) for c in clients),
        "mean_output_tokens": sum(float(c.get("mean_output_tokens", 0)) * n for c, n in zip(clients, requests,
                                                                                             strict=True)) / total,
        "prompt_lengths": lengths,
        "instances": {"prefill": max(int((c.get("instances") or {}).get("prefill", 0)) for c in clients),
                      "decode": sum(int((c.get("instances") or {}).get("decode", 0)) for c in clients)},
        "offload_threshold_tokens": max(int(c.get("offload_threshold_tokens", 0)) for c in clients),
        "clusters": len(clients)}


def _size(dist: LengthDist, t: int, rate: float, profile: SpeedProfile, decode_s: float, kv: Any, link_bps: float,
          u: float) -> dict[str, Any]:
    pairs = list(zip(dist.lengths, dist.weights, strict=True))
    p = sum(w for n, w in pairs if n > t)
    remote_s = sum(w * profile.prefill_seconds(n) for n, w in pairs if n > t)  # λ·p·E[T|l>t] / λ
    local_s = sum(w * profile.prefill_seconds(n) for n, w in pairs if n <= t)
    egress = rate * sum(w * 8 * kv(n) for n, w in pairs if n > t)
    prefill = math.ceil(rate * remote_s / u) if p > 0 else 0
    decode = max(1, math.ceil(rate * (local_s + decode_s) / u))
    return {"t": t, "p": p, "prefill": prefill, "decode": decode, "egress": egress}


def _decode_seconds_per_request(profile: SpeedProfile, out_tokens: float) -> float:
    """Decode-instance seconds one request takes at the profile's largest measured batch."""
    if not profile.decode:
        return 0.0
    batch, tpot = profile.decode[-1]
    return out_tokens * tpot / batch


def _kv_bytes(profile: SpeedProfile, signals: dict[str, Any]) -> Any:
    points = profile.kv_points()
    if points:
        table = tuple((n, float(b)) for n, b in points)
        return lambda n: interpolate(table, n)
    per_token = 0.0  # no KV sizes in the profile: what the router saw go over the wire
    remote_rate = float(signals.get("arrival_rps", 0)) * float(signals.get("offload_fraction", 0))
    if remote_rate > 0:
        per_token = float(signals.get("kv_egress_bps", 0)) / 8 / remote_rate / max(
            1, int(signals.get("offload_threshold_tokens", 0)) + 1)
    return lambda n: per_token * n


def _reasons(signals: dict[str, Any], best: dict[str, Any], usable_bps: float) -> list[str]:
    have = signals.get("instances", {})
    why = [f"now: {have.get('prefill', '?')} prefill, {have.get('decode', '?')} decode, threshold "
           f"{signals.get('offload_threshold_tokens', '?')}, offload fraction {signals.get('offload_fraction', 0):.2f}"]
    if signals.get("prefill_queue_wait_s", 0) > 1.0:
        why.append(f"prefill queues: expected wait {signals['prefill_queue_wait_s']:.2f} s")
    if signals.get("decode_queue_depth", 0) > 0 and have.get("decode"):
        why.append(f"decode holds {signals['decode_queue_depth']} requests over {have['decode']} instances")
    if usable_bps and best["egress"] > usable_bps:
        why.append("even the best threshold needs more than the usable link share: compress the KV or add link")
    return why


def render(advice: Advice) -> str:
    return "\n".join([
        f"recommended: {advice.prefill_instances} prefill : {advice.decode_instances} decode, "
        f"offload_threshold_tokens {advice.offload_threshold_tokens}",
        f"expected offload fraction {advice.offload_fraction:.2f}, KV egress {advice.kv_egress_bps / 1e9:.3f} Gbit/s "
        f"({advice.link_utilisation:.1%} of the link)",
        *(f"  {r}" for r in advice.reasons)])
