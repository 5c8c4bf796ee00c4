"""What an autoscaler needs, published by the router: over the last ``WINDOW_S`` seconds of finished requests
and the instances' latest heartbeats. ``GET /admin/signals`` returns ``snapshot``; the same figures are Prometheus
gauges (``prfaas_router_*``; see docs/runbook.md for HPA / KEDA) and the input of ``prfaas admin recommend``.

Owned by the router's event loop (no locks); a snapshot with no traffic reports zero rates, never fails.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prfaas.messages import InstanceInfo
from prfaas.obs import metrics
from prfaas.scheduler.speed import PrefillSpeed

WINDOW_S = 60.0


@dataclass(frozen=True)
class Finished:
    at: float
    prompt_tokens: int
    output_tokens: int
    remote: bool
    kv_bytes: int


class Signals:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._done: collections.deque[Finished] = collections.deque()

    def record(self, prompt_tokens: int, output_tokens: int, route: str, kv_bytes: int) -> None:
        self._done.append(Finished(self.clock(), prompt_tokens, output_tokens, route == "remote", kv_bytes))
        self._trim()

    def _trim(self) -> None:
        horizon = self.clock() - WINDOW_S
        while self._done and self._done[0].at < horizon:
            self._done.popleft()

    def snapshot(self, prefills: list[InstanceInfo], decodes: list[InstanceInfo],
                 speeds: dict[str, PrefillSpeed], threshold: int) -> dict[str, Any]:
        self._trim()
        done = list(self._done)
        remote = [d for d in done if d.remote]
        mean_remote = sum(d.prompt_tokens for d in remote) / len(remote) if remote else float(threshold + 1)
        waits = [i.queue_depth * speeds.get(i.instance_id, PrefillSpeed()).seconds(int(mean_remote))
                 for i in prefills]
        lengths: collections.Counter[int] = collections.Counter(_bucket(d.prompt_tokens) for d in done)
        out = {
            "window_s": WINDOW_S, "requests": len(done), "arrival_rps": len(done) / WINDOW_S,
            "offload_fraction": len(remote) / len(done) if done else 0.0,
            "prefill_queue_wait_s": max(waits, default=0.0),
            "decode_queue_depth": sum(i.queue_depth for i in decodes),
            "decode_free_kv_bytes": sum(i.free_kv_bytes for i in decodes),
            "kv_egress_bps": 8 * sum(d.kv_bytes for d in remote) / WINDOW_S,
            "mean_output_tokens": sum(d.output_tokens for d in done) / len(done) if done else 0.0,
            "prompt_lengths": {str(k): v for k, v in sorted(lengths.items())},
            "instances": {"prefill": len(prefills), "decode": len(decodes)},
            "offload_threshold_tokens": threshold,
        }
        _publish(out)
        return out


def _bucket(tokens: int) -> int:
    """Prompt lengths rounded up to a power of two (at least 16): a distribution small enough to publish."""
    n = 16
    while n < tokens:
        n *= 2
    return n


def _publish(s: dict[str, Any]) -> None:
    metrics.SIGNAL_PREFILL_WAIT.set(s["prefill_queue_wait_s"])
    metrics.SIGNAL_DECODE_QUEUE.set(s["decode_queue_depth"])
    metrics.SIGNAL_DECODE_FREE_KV.set(s["decode_free_kv_bytes"])
    metrics.SIGNAL_KV_EGRESS.set(s["kv_egress_bps"])
    metrics.SIGNAL_OFFLOAD_FRACTION.set(s["offload_fraction"])
    metrics.SIGNAL_ARRIVAL.set(s["arrival_rps"])
