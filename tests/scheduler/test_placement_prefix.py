"""Cache-aware placement: instances' heartbeat summaries of held prefix blocks steer decode and prefill placement
towards the instance holding a prompt's prefix unless its queue costs more than the hit saves, and the offload
decision weighs only the tokens the decode instance lacks."""

from __future__ import annotations

import random

import pytest

from prfaas.config import RouterConfig
from prfaas.engine.prefix_cache import PrefixCache
from prfaas.errors import InvalidRequest
from prfaas.kv import Fingerprint, KVState, LayerState
from prfaas.kv import state as kinds
from prfaas.kv.prefix import BLOCK_TOKENS, block_hashes, held_tokens, pool_tenant, prefix_salt, summary_key
from prfaas.messages import MAX_PREFIX_BLOCKS, InstanceInfo
from prfaas.scheduler import PrefillSpeed, Scheduler
from prfaas.scheduler.offload import Estimator
from prfaas.scheduler.placement import PromptPrefix, pick_decode, pick_prefill

FP = Fingerprint("m", "llama", "w1", "t1", "float32", 2048)
PROMPT = list(range(100, 300))  # 200 tokens: 12 full blocks, 192 reusable


def held_by(tenant: str, tokens: list[int]) -> list[str]:
    """The summary of an instance that served ``tokens`` for ``tenant`` (most recent, the deepest, first)."""
    return [summary_key(h) for h in reversed(block_hashes(tokens, prefix_salt(FP, tenant)))]


def inst(name: str, role: str = "decode", queue: int = 0, held: list[str] | None = None) -> InstanceInfo:
    return InstanceInfo(instance_id=name, role=role, url=f"http://{name}", kv_address=f"{name}:1",
                        free_kv_bytes=10**9, kv_budget_bytes=10**9, queue_depth=queue, fingerprint=FP.to_wire(),
                        prefix_blocks=held or [])


def speed(_: InstanceInfo) -> PrefillSpeed:
    return PrefillSpeed()


def test_held_tokens_stop_at_the_deepest_held_block_and_leave_the_last_token() -> None:
    hashes = block_hashes(PROMPT, prefix_salt(FP, "acme"))
    assert held_tokens(hashes, set(held_by("acme", PROMPT[:64])), len(PROMPT)) == 64
    assert held_tokens(hashes, {summary_key(hashes[5])}, len(PROMPT)) == 96  # one hash stands for its chain
    assert held_tokens(hashes[:2], set(held_by("acme", PROMPT[:32])), 32) == 16  # one token left to compute


def test_a_cache_summary_names_its_most_recent_blocks_deepest_first() -> None:
    cache = PrefixCache(budget_bytes=1 << 20)
    keys = block_hashes(PROMPT[:48], prefix_salt(FP, "acme"))
    hit = cache.lookup(keys, 49)
    layers = [LayerState(index=0, kind=kinds.NONE, grows=False)]  # bookkeeping only: blocks without bytes
    cache.store(hit, KVState(fingerprint=FP, seq_len=48, layers=layers, cache="C"))
    cache.release(hit)
    assert cache.summary() == tuple(summary_key(k) for k in reversed(keys))
    assert cache.summary(limit=1) == (summary_key(keys[-1]),)


@pytest.mark.parametrize("seed", range(8))
def test_decode_placement_prefers_the_instance_holding_the_prefix(seed: int) -> None:
    instances = [inst("a"), inst("b", held=held_by("acme", PROMPT[:160])), inst("c")]
    best = pick_decode(instances, random.Random(seed), PromptPrefix(PROMPT, "acme"), speed)
    assert best is not None and best.instance_id == "b"


def test_decode_placement_leaves_an_overloaded_holder() -> None:
    instances = [inst("a"), inst("b", queue=2, held=held_by("acme", PROMPT))]
    best = pick_decode(instances, random.Random(0), PromptPrefix(PROMPT, "acme"), speed)
    assert best is not None and best.instance_id == "a"  # two prompts' prefills ahead outweigh 192 cached tokens


def test_another_tenants_prefix_is_no_hit() -> None:
    prompt = PromptPrefix(PROMPT, "globex")
    assert prompt.held(inst("b", held=held_by("acme", PROMPT))) == 0
    assert PromptPrefix(PROMPT, "acme").held(inst("b", held=held_by("acme", PROMPT))) == 192


def test_prefill_placement_weighs_the_hit_against_the_queue() -> None:
    holder = inst("b", "prefill", held=held_by(pool_tenant("default", "acme"), PROMPT))
    prompt = PromptPrefix(PROMPT, "acme")
    best = pick_prefill([inst("a", "prefill"), holder], len(PROMPT), {}, lambda _: True, prompt)
    assert best is not None and best.instance_id == "b"
    busy = inst("b", "prefill", queue=1, held=held_by(pool_tenant("default", "acme"), PROMPT))
    best = pick_prefill([inst("a", "prefill"), busy], len(PROMPT), {}, lambda _: True, prompt)
    assert best is not None and best.instance_id == "a"


def test_a_shared_prefill_instance_holds_a_tenant_name_apart_per_client_cluster() -> None:
    """Every cluster has a tenant ``default``: on a prefill pool shared by two clusters, one's prefix is not the
    other's (the instance salts with the cluster its gate proved, ``pool_tenant``)."""
    pool = inst("p", "prefill", held=held_by(pool_tenant("east", "default"), PROMPT))
    assert PromptPrefix(PROMPT, "default", "east").held(pool) == 192
    assert PromptPrefix(PROMPT, "default", "west").held(pool) == 0
    decode = inst("d", held=held_by("default", PROMPT))  # a decode instance serves one cluster: the tenant alone
    assert PromptPrefix(PROMPT, "default", "west").held(decode) == 192


def test_the_offload_threshold_counts_only_the_decode_instances_uncached_tokens() -> None:
    scheduler = Scheduler(RouterConfig(offload_threshold_tokens=64), "direct", random.Random(0))
    prefills = [inst("p", "prefill")]
    cold, warm = inst("d"), inst("d", held=held_by("acme", PROMPT))
    assert scheduler.route(len(PROMPT), prefills, [], decode=cold, prompt=PromptPrefix(PROMPT, "acme")).route \
        == "remote"
    decision = scheduler.route(len(PROMPT), prefills, [], decode=warm, prompt=PromptPrefix(PROMPT, "acme"))
    assert (decision.route, decision.reason_code) == ("local", "below_threshold")
    assert "8 not cached" in decision.reason


def test_the_cost_model_times_each_route_by_what_its_instance_lacks() -> None:
    estimator = Estimator()
    plain = estimator.inputs(200, 1e6, inst("p", "prefill"), inst("d"))
    cached = estimator.inputs(200, 1e6, inst("p", "prefill"), inst("d"), held=(96, 192))
    assert cached.remote_prefill_s == pytest.approx(plain.remote_prefill_s * 104 / 200)
    assert cached.local_prefill_s == pytest.approx(plain.local_prefill_s * 8 / 200)
    assert cached.kv_bytes == plain.kv_bytes  # the whole prompt's KV is still shipped


@pytest.mark.parametrize("held", [["0" * 15], ["0" * 16] * (MAX_PREFIX_BLOCKS + 1), "00", [7]])
def test_a_heartbeat_with_a_bad_summary_is_refused(held: object) -> None:
    with pytest.raises(InvalidRequest):
        InstanceInfo.from_json({"instance_id": "a", "role": "decode", "url": "http://a", "prefix_blocks": held})


def test_a_summary_block_count_is_bounded() -> None:
    assert BLOCK_TOKENS == 16
    assert len(held_by("acme", list(range(MAX_PREFIX_BLOCKS * BLOCK_TOKENS)))) == MAX_PREFIX_BLOCKS
