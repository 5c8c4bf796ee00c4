"""The PrfaaS throughput model (paper §capacity): requests longer than threshold ``t`` (fraction ``p``)
prefill remotely, the rest on local prefill instances; every request decodes locally.

    Λ_max(t, N_p) = min(Θ_prfaas / p, Θ_local(N_p) / (1 − p), Θ_decode(N_local − N_p))
    Θ_prfaas = min(N_prfaas / E[T_prefill(l) | l > t],  share × B / E[8 · KV(l) | l > t])
    Θ_local  = N_p / E[T_prefill_local(l) | l ≤ t],    Θ_decode = N_d × batch / (output_len × TPOT(batch))

A term whose traffic is empty (p = 0 or p = 1) is unbounded. ``t`` ranges over the distribution's lengths (and
"offload all" / "offload none"); ``N_p`` over 1 … N_local − 1 (0 when nothing stays local).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from prfaas.errors import InvalidRequest
from prfaas.plan.lengths import LengthDist


@dataclass(frozen=True)
class Cluster:
    prfaas_instances: int
    local_instances: int
    link_bps: float
    link_share: float = 0.7
    decode_rate: float | None = None  # requests/s one decode instance finishes; None = unbounded


@dataclass(frozen=True)
class Point:
    threshold: int  # prompts longer than this go remote; -1 = all remote
    p: float
    local_prefill: int
    decode: int
    theta_prfaas: float
    theta_prfaas_compute: float
    theta_prfaas_link: float
    theta_local: float
    theta_decode: float
    lambda_max: float
    bound: str


Fn = Callable[[int], float]


def _cond_mean(dist: LengthDist, fn: Fn, keep: Callable[[int], bool]) -> tuple[float, float]:
    mass = sum(w for n, w in zip(dist.lengths, dist.weights, strict=True) if keep(n))
    if mass <= 0:
        return 0.0, 0.0
    total = sum(w * fn(n) for n, w in zip(dist.lengths, dist.weights, strict=True) if keep(n))
    return mass, total / mass


def _safe_div(a: float, b: float) -> float:
    return math.inf if b <= 0 else a / b


def evaluate(dist: LengthDist, t: int, n_p: int, c: Cluster, remote_prefill: Callable[[int], float],
             local_prefill: Callable[[int], float], kv_bytes: Callable[[int], float]) -> Point:
    p, t_remote = _cond_mean(dist, remote_prefill, lambda n: n > t)
    _, kv_remote = _cond_mean(dist, kv_bytes, lambda n: n > t)
    _, t_local = _cond_mean(dist, local_prefill, lambda n: n <= t)
    compute = _safe_div(c.prfaas_instances, t_remote)
    link = _safe_div(c.link_share * c.link_bps, 8 * kv_remote)
    theta_r = min(compute, link)
    theta_l = _safe_div(n_p, t_local)
    n_d = c.local_instances - n_p
    theta_d = math.inf if c.decode_rate is None else n_d * c.decode_rate
    terms = {
        "prfaas_compute" if compute <= link else "prfaas_link": _safe_div(theta_r, p) if p > 0 else math.inf,
        "local_prefill": _safe_div(theta_l, 1 - p) if p < 1 - 1e-12 else math.inf,
        "decode": theta_d,
    }
    bound = min(terms, key=lambda k: terms[k])
    return Point(t, p, n_p, n_d, theta_r, compute, link, theta_l, theta_d, terms[bound], bound)


def optimise(dist: LengthDist, c: Cluster, remote_prefill: Callable[[int], float],
             local_prefill: Callable[[int], float], kv_bytes: Callable[[int], float]) -> list[Point]:
    """The best split for every threshold, best threshold first."""
    if c.local_instances < 1 or c.prfaas_instances < 0:
        raise InvalidRequest("need at least one local instance (for decode) and a non-negative PrfaaS count")
    best: list[Point] = []
    for t in (-1, *dist.lengths):
        all_remote = t < dist.lengths[0]
        splits = [0] if all_remote else range(1, c.local_instances) if c.local_instances > 1 else [0]
        if c.prfaas_instances == 0 and t < dist.lengths[-1]:
            continue  # nothing can go remote
        cands = [evaluate(dist, t, n_p, c, remote_prefill, local_prefill, kv_bytes) for n_p in splits]
        best.append(max(cands, key=lambda pt: pt.lambda_max))
    if not best:
        raise InvalidRequest("no feasible configuration")
    return sorted(best, key=lambda pt: -pt.lambda_max)


def point_json(pt: Point) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(pt).items()}
