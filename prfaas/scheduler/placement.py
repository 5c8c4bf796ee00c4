"""Placement: which decode instance takes a request, which prefill instance prefills it.

Decode (the source documents' pseudocode): candidates are healthy, allowed by their circuit breaker, have free KV
memory ≥ the request's expected KV bytes and a queue under ``decode_queue_limit``; of two random candidates the
one with the shorter queue wins, ties to the one with more free memory (power of two choices: near-best balance
without herding every router onto the same instance). Prefill: the shortest expected wait, queue depth × the
instance's expected prefill time for this length.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from prfaas.messages import InstanceInfo
from prfaas.scheduler.speed import PrefillSpeed


def decode_candidates(instances: list[InstanceInfo], need_kv_bytes: int, queue_limit: int,
                      allow: Callable[[str], bool]) -> list[InstanceInfo]:
    return [i for i in instances
            if allow(i.instance_id) and i.free_kv_bytes >= need_kv_bytes and i.queue_depth < queue_limit]


def pick_decode(candidates: list[InstanceInfo], rng: random.Random) -> InstanceInfo | None:
    if not candidates:
        return None
    pair = rng.sample(candidates, 2) if len(candidates) > 2 else candidates
    return min(pair, key=lambda i: (i.queue_depth, -i.free_kv_bytes, i.instance_id))


def pick_prefill(instances: list[InstanceInfo], tokens: int, speeds: dict[str, PrefillSpeed],
                 allow: Callable[[str], bool]) -> InstanceInfo | None:
    default = PrefillSpeed()

    def expected_wait(info: InstanceInfo) -> tuple[float, str]:
        speed = speeds.get(info.instance_id, default)
        return (info.queue_depth + 1) * speed.seconds(tokens), info.instance_id

    allowed = [i for i in instances if allow(i.instance_id)]
    return min(allowed, key=expected_wait, default=None)
