"""Where the router's online cost model (``prfaas.scheduler.cost``) settles under a steady load, so that the
planner's Λ_max model (``prfaas.plan.capacity``) and the online one can be compared on the same inputs.

The online router has no split of local instances: a decode instance prefills the prompts kept local. So the
planner side here is ``capacity.evaluate`` with every local instance prefilling (``n_p = local_instances``) and
the decode term left to the cluster's ``decode_rate``.

Steady state at threshold ``t`` and Poisson load λ: each side's utilisation is its share of λ times its mean
service time over its instances (the same means Λ_max uses), ρ_r = λ p E[T_r | l > t] / N_prfaas and
ρ_l = λ (1 − p) E[T_l | l ≤ t] / N_local, and its queue wait the M/M/1 figure ρ / (1 − ρ) × mean service. The
link's KV rate λ p E[8 KV | l > t] is bounded by ``link_share`` × B, as online (``link_busy``), and its bytes in
flight are the M/M/1 figure for the link, ρ_link / (1 − ρ_link) × E[KV | l > t] with ρ_link that rate over B
(what the router counts as in flight when it routes). Fed those waits,
the online model sends a length remote when its predicted TTFT there is not worse; the threshold it settles at is
the smallest ``t`` at which it would not offload more than it does (every length it sends remote is above
``t``'s next length), with an overloaded remote side or link pushing ``t`` up and an overloaded local side
pushing it down.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from prfaas.plan.capacity import Cluster, Point, evaluate
from prfaas.plan.lengths import LengthDist
from prfaas.scheduler.cost import Inputs, LinkView, decide

Fn = Callable[[int], float]


def planner_best(dist: LengthDist, c: Cluster, remote_prefill: Fn, local_prefill: Fn, kv_bytes: Fn) -> Point:
    """Λ_max's best threshold with every local instance prefilling (the online router's setting)."""
    points = [evaluate(dist, t, c.local_instances, c, remote_prefill, local_prefill, kv_bytes)
              for t in (-1, *dist.lengths)]
    return max(points, key=lambda pt: pt.lambda_max)


def _mean(dist: LengthDist, fn: Fn, keep: Callable[[int], bool]) -> tuple[float, float]:
    pairs = [(w, fn(n)) for n, w in zip(dist.lengths, dist.weights, strict=True) if keep(n)]
    mass = sum(w for w, _ in pairs)
    return mass, (sum(w * v for w, v in pairs) / mass if mass > 0 else 0.0)


def _wait(rho: float, service_s: float) -> float:
    return math.inf if rho >= 1 else rho / (1 - rho) * service_s


def _first_remote(dist: LengthDist, wait_r: float, wait_l: float, link: LinkView, remote_prefill: Fn,
                  local_prefill: Fn, kv_bytes: Fn) -> float:
    for n in dist.lengths:
        inputs = Inputs(kv_bytes(n), wait_r, remote_prefill(n), 0.0, wait_l, local_prefill(n))
        if decide(inputs, link).route == "remote":
            return n
    return math.inf


def steady_threshold(dist: LengthDist, load: float, c: Cluster, remote_prefill: Fn, local_prefill: Fn,
                     kv_bytes: Fn, chunk_bytes: int = 4 << 20) -> int:
    """The threshold (``-1`` = all remote) the online model settles at under ``load`` requests/s."""
    thresholds = (-1, *dist.lengths)
    for i, t in enumerate(thresholds):
        def above(n: int, t: int = t) -> bool:
            return n > t

        p, t_r = _mean(dist, remote_prefill, above)
        _, t_l = _mean(dist, local_prefill, lambda n: not above(n))
        _, kv = _mean(dist, kv_bytes, above)
        rho_r = load * p * t_r / max(c.prfaas_instances, 1e-9) if p > 0 else 0.0
        rho_l = load * (1 - p) * t_l / c.local_instances
        rho_link = load * p * 8 * kv / c.link_bps
        if rho_r >= 1 or rho_link > c.link_share:
            continue  # the remote side or the link cannot take this much: offload less
        if rho_l >= 1:
            return t  # the local side cannot take more
        link = LinkView(c.link_bps, rho_link / (1 - rho_link) * kv, chunk_bytes)
        first = _first_remote(dist, _wait(rho_r, t_r), _wait(rho_l, t_l), link, remote_prefill, local_prefill,
                              kv_bytes)
        if first <= (thresholds[i + 1] if i + 1 < len(thresholds) else math.inf):
            return t
    return thresholds[-1]
