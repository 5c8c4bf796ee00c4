"""A simulated PrfaaS cluster for comparing offload policies (no model runs; ``benchmarks/scheduler.py``).

Model (written into the benchmark's JSON):
- Poisson arrivals; remote prefill: ``prefill`` instances, FIFO, each request on the instance free first;
- the KV streams over one shared link while the prefill runs (layer-wise): the link serves transfers in order, a
  transfer ends at ``max(link free + kv / B, prefill end + chunk / B)``; the bandwidth ``B`` may change at a given
  time (``Sim.bandwidth_at``);
- local prefill: on the request's decode instance (round robin), FIFO, at ``local_prefill`` speed;
- decode: continuous batching, TPOT = 25 ms + 0.25 ms × batch, at most 64 sequences per instance.
Throughput is completed requests per second of simulated time; TTFT percentiles over all requests; ``link_load``
the KV rate the policy routed (after the change, if any) over the link's bandwidth then: above 1 the link falls
behind for good, above ``link_share`` it breaks the 70 % rule.

The online policy is the router's own code, driven by the simulated clock: ``prfaas.scheduler.cost.decide`` for
the route and a ``prfaas.scheduler.links.Link`` (``Link.decide``) for the link's budget, its bytes in flight and
its bandwidth *estimate* (fed by the simulated transfers as they end, never told the true bandwidth).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from prfaas.scheduler.cost import Inputs
from prfaas.scheduler.link import LinkMonitor
from prfaas.scheduler.links import Bandwidth, Link

Fn = Callable[[int], float]
OUTPUT_TOKENS, MAX_BATCH = 256, 64
TPOT_BASE_S, TPOT_PER_SEQ_S = 0.025, 0.00025


@dataclass(frozen=True)
class Sim:
    remote_prefill: Fn
    local_prefill: Fn
    kv_bytes: Fn
    prefill: int
    decode: int
    link_bps: float
    link_share: float = 0.7
    chunk_bytes: int = 4 << 20
    change_at_s: float = math.inf  # from this simulated time on, the link delivers ``change_factor`` × link_bps
    change_factor: float = 1.0

    def bandwidth_at(self, t: float) -> float:
        return self.link_bps * (self.change_factor if t >= self.change_at_s else 1.0)


@dataclass
class _State:
    sim: Sim
    now: float = 0.0
    remote_free: list[float] = field(default_factory=list)
    local_free: list[float] = field(default_factory=list)
    link_free: float = 0.0
    pending: list[tuple[float, float, float, float]] = field(default_factory=list)  # (end, bytes, prefill end, s)
    link: Link | None = None


Policy = Callable[[_State, int, int], bool]  # (state, prompt length, decode instance) → remote?


def fixed(threshold: float) -> Policy:
    return lambda state, n, d: n > threshold


def online(floor: int = 0) -> Policy:
    """The router's cost policy (``offload_policy: cost``) over the simulated state."""
    def choose(state: _State, n: int, d: int) -> bool:
        sim, link = state.sim, state.link
        assert link is not None
        if n <= floor:
            return False
        remote_wait = max(0.0, min(state.remote_free) - state.now)
        inputs = Inputs(sim.kv_bytes(n), remote_wait, sim.remote_prefill(n), 0.0,
                        max(0.0, state.local_free[d] - state.now), sim.local_prefill(n))
        return link.decide(inputs, sim.chunk_bytes).route == "remote"
    return choose


def _deliver(state: _State) -> None:
    """Transfers that ended by now: their bytes leave the link's in-flight count and feed its estimate."""
    assert state.link is not None
    while state.pending and state.pending[0][0] <= state.now:
        end, kv, done, prefill_s = heapq.heappop(state.pending)
        state.link.delivered(kv)
        state.link.transfer_done(kv, end - done, state.sim.chunk_bytes, at=end, prefill_s=prefill_s)


def _remote(state: _State, n: int) -> float:
    sim = state.sim
    k = min(range(sim.prefill), key=state.remote_free.__getitem__)
    start = max(state.now, state.remote_free[k])
    prefill_s = sim.remote_prefill(n)
    done = start + prefill_s
    state.remote_free[k] = done
    kv = sim.kv_bytes(n)
    bw = sim.bandwidth_at(state.now)
    assert state.link is not None
    state.link.send(kv)
    link_start = max(start, state.link_free)
    state.link_free = max(link_start + kv * 8 / bw, done + min(kv, sim.chunk_bytes) * 8 / bw)
    heapq.heappush(state.pending, (state.link_free, kv, done, prefill_s))
    return state.link_free


def run(sim: Sim, policy: Policy, rate: float, prompts: list[int], gaps: list[float]) -> dict[str, float]:
    """Serve ``prompts`` arriving ``gaps`` apart (seconds, scaled by 1 / ``rate``) under ``policy``."""
    state = _State(sim, remote_free=[0.0] * sim.prefill, local_free=[0.0] * sim.decode)
    state.link = Link(("sim", "sim"), LinkMonitor(math.inf, 0.0), Bandwidth(sim.link_bps), lambda: state.now,
                      sim.link_share)
    ends: list[list[float]] = [[] for _ in range(sim.decode)]
    ttfts, finishes, remote, sent, sent_after = [], [], 0, 0.0, 0.0
    since = 0.0 if math.isinf(sim.change_at_s) else sim.change_at_s
    for i, (n, gap) in enumerate(zip(prompts, gaps, strict=True)):
        state.now += gap / rate
        _deliver(state)
        d = i % sim.decode
        if policy(state, n, d):
            remote += 1
            sent += sim.kv_bytes(n)
            sent_after += sim.kv_bytes(n) if state.now >= since else 0.0
            first = _remote(state, n)
        else:
            first = max(state.now, state.local_free[d]) + sim.local_prefill(n)
            state.local_free[d] = first
        first = _decode_slot(ends[d], first)
        batch = sum(1 for e in ends[d] if e > first)
        finish = first + OUTPUT_TOKENS * (TPOT_BASE_S + TPOT_PER_SEQ_S * batch)
        heapq.heappush(ends[d], finish)
        ttfts.append(first - state.now)
        finishes.append(finish)
    ttfts.sort()
    span = max(finishes)
    return {"throughput_rps": len(prompts) / span, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[int(0.99 * (len(ttfts) - 1))], "offload_fraction": remote / len(prompts),
            "link_gbps": 8 * sent / span / 1e9,
            "link_load": 8 * sent_after / max(state.now - since, 1e-9) / sim.bandwidth_at(since)}


def _decode_slot(ends: list[float], ready: float) -> float:
    """A decode instance holds at most MAX_BATCH sequences: wait for a slot if it is full."""
    while ends and ends[0] <= ready:
        heapq.heappop(ends)
    if len(ends) < MAX_BATCH:
        return ready
    return max(ready, heapq.heappop(ends))


def paper_workload(n: int) -> tuple[list[int], list[float]]:
    """The paper's mix: log-normal μ 9.90, σ 1.00 truncated to 128–128K; Poisson gaps for a rate of 1/s."""
    rng = random.Random(0)
    prompts: list[int] = []
    while len(prompts) < n:
        length = int(math.exp(rng.gauss(9.90, 1.00)))
        if 128 <= length <= 131072:
            prompts.append(length)
    gaps = random.Random(1)
    return prompts, [gaps.expovariate(1.0) for _ in prompts]
