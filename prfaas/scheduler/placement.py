"""Placement: which decode instance takes a request, which prefill instance prefills it.

Decode (the source documents' pseudocode): candidates are healthy, allowed by their circuit breaker, have free KV
memory ≥ the request's expected KV bytes and a queue under ``decode_queue_limit``; of two random candidates the
one with the shorter queue wins, ties to the one with more free memory (power of two choices: near-best balance
without herding every router onto the same instance). Prefill: the shortest expected wait, queue depth × the
instance's expected prefill time for this length.

Cache-aware (docs/prefix-cache.md): instances report the prefix blocks they hold (``InstanceInfo.prefix_blocks``,
at most ``prfaas.kv.prefix.SUMMARY_BLOCKS`` chain hashes), and ``PromptPrefix`` hashes the prompt's blocks with
the salt each instance's engine uses (its fingerprint and the request's tenant), so ``held`` is the tokens an
instance would reuse. An instance's score is then its expected seconds to the prompt's first token,

    wait = queue_depth × prefill(prompt) + prefill(prompt − held)

(each request ahead counted as one prefill of this length, as before; its own prefill only of what it lacks).
Prefill instances take the lowest wait. Decode instances do too when any candidate holds part of the prompt, with
their pool's local prefill speed (one for all its instances); without a hit they keep the power of two choices. So
a hit wins among equal queues, and a longer queue outweighs it (a request ahead costs one whole prefill, a hit
saves at most one): the overlap-vs-load weighing of Dynamo's KV router, in seconds instead of a tuned weight.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from prfaas.errors import PrfaasError
from prfaas.kv.fingerprint import Fingerprint
from prfaas.kv.prefix import BLOCK_TOKENS, block_hashes, chain_hex, held_tokens, pool_tenant, prefix_salt
from prfaas.kv.state import PrefixRef
from prfaas.messages import InstanceInfo
from prfaas.scheduler.speed import PrefillSpeed
from prfaas.tenancy.clusters import DEFAULT_CLUSTER

SpeedOf = Callable[[InstanceInfo], PrefillSpeed]  # a decode instance's (its pool's) prefill speed


class PromptPrefix:
    """One request's prompt and tenant; ``held`` is the tokens of it an instance's summary says it can reuse. The
    chain is hashed once per distinct fingerprint (instances of one model share it)."""

    def __init__(self, token_ids: list[int], tenant: str, cluster: str = DEFAULT_CLUSTER) -> None:
        self.token_ids, self.tenant, self.cluster = token_ids, tenant, cluster
        self._chains: dict[tuple[str, str], list[int]] = {}

    def held(self, info: InstanceInfo) -> int:
        if not info.prefix_blocks or len(self.token_ids) <= BLOCK_TOKENS:
            return 0
        # a prefill instance may serve several clusters and salts with this router's cluster too (pool_tenant)
        tenant = pool_tenant(self.cluster, self.tenant) if info.role == "prefill" else self.tenant
        chain = self._chain(info.fingerprint, tenant)
        return held_tokens(chain, frozenset(info.prefix_blocks), len(self.token_ids)) if chain else 0

    def extends(self, info: InstanceInfo) -> PrefixRef | None:
        """The prefix of the prompt decode instance ``info`` holds, as a suffix-only blob names it (the chain hash
        of its last block under the instance's salt, and its tokens); None when it holds none."""
        held = self.held(info)
        if not held:
            return None
        return PrefixRef(chain_hex(self._chain(info.fingerprint, self.tenant)[held // BLOCK_TOKENS - 1]), held)

    def _chain(self, fingerprint: dict[str, object], tenant: str) -> list[int]:
        key = (repr(sorted(fingerprint.items())), tenant)
        if key not in self._chains:
            try:
                salt = prefix_salt(Fingerprint.from_wire(fingerprint), tenant)
            except PrfaasError:  # an instance without a whole fingerprint holds nothing this prompt can name
                self._chains[key] = []
            else:
                self._chains[key] = block_hashes(self.token_ids, salt)
        return self._chains[key]


def expected_wait(info: InstanceInfo, tokens: int, speed: PrefillSpeed, prompt: PromptPrefix | None) -> float:
    """Seconds to this prompt's first token on ``info`` (see the module doc)."""
    held = prompt.held(info) if prompt is not None else 0
    return info.queue_depth * speed.seconds(tokens) + speed.seconds(tokens - held)


def decode_candidates(instances: list[InstanceInfo], need_kv_bytes: int, queue_limit: int,
                      allow: Callable[[str], bool]) -> list[InstanceInfo]:
    return [i for i in instances
            if allow(i.instance_id) and i.free_kv_bytes >= need_kv_bytes and i.queue_depth < queue_limit]


def pick_decode(candidates: list[InstanceInfo], rng: random.Random, prompt: PromptPrefix | None = None,
                speed_of: SpeedOf | None = None) -> InstanceInfo | None:
    """The decode instance for a request; with ``prompt`` and ``speed_of`` (local prefill speeds), the lowest
    expected wait when any candidate holds part of the prompt."""
    if not candidates:
        return None
    if prompt is not None and speed_of is not None and any(prompt.held(i) for i in candidates):
        tokens = len(prompt.token_ids)
        return min(candidates, key=lambda i: (expected_wait(i, tokens, speed_of(i), prompt),
                                              i.queue_depth, -i.free_kv_bytes, i.instance_id))
    pair = rng.sample(candidates, 2) if len(candidates) > 2 else candidates
    return min(pair, key=lambda i: (i.queue_depth, -i.free_kv_bytes, i.instance_id))


def pick_prefill(instances: list[InstanceInfo], tokens: int, speeds: dict[str, PrefillSpeed],
                 allow: Callable[[str], bool], prompt: PromptPrefix | None = None) -> InstanceInfo | None:
    """The allowed prefill instance with the lowest expected wait (counting what it holds of ``prompt``)."""
    default = PrefillSpeed()

    def wait(info: InstanceInfo) -> tuple[float, str]:
        return expected_wait(info, tokens, speeds.get(info.instance_id, default), prompt), info.instance_id

    allowed = [i for i in instances if allow(i.instance_id)]
    return min(allowed, key=wait, default=None)
