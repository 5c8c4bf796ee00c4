from __future__ import annotations

import dataclasses
import random

import pytest

from prfaas.config import RouterConfig
from prfaas.errors import KVIncompatible, KVUnavailable, RateLimited
from prfaas.kv import Fingerprint
from prfaas.messages import InstanceInfo
from prfaas.scheduler import CircuitBreaker, LinkMonitor, PrefillSpeed, Scheduler, TokenBucket
from prfaas.scheduler.breaker import CLOSED, HALF_OPEN, OPEN
from prfaas.scheduler.offload import Estimator
from prfaas.scheduler.placement import decode_candidates, pick_decode, pick_prefill
from prfaas.scheduler.speed import WINDOW
from prfaas.services.registry import Registry
from tests.clock import Clock


def inst(name: str, role: str = "decode", queue: int = 0, free: int = 10**9, fp: dict | None = None) -> InstanceInfo:
    return InstanceInfo(instance_id=name, role=role, url=f"http://{name}", kv_address=f"{name}:1",
                        free_kv_bytes=free, kv_budget_bytes=10**9, queue_depth=queue, fingerprint=fp or {})


def test_breaker_opens_then_probes_then_closes() -> None:
    clock = Clock()
    breaker = CircuitBreaker(threshold=3, cooldown_s=5, clock=clock)
    for _ in range(2):
        breaker.failure("a")
    assert breaker.allow("a") and breaker.state("a") == CLOSED
    breaker.failure("a")
    assert breaker.state("a") == OPEN and not breaker.allow("a")
    clock.now = 5.0
    assert breaker.state("a") == HALF_OPEN
    assert breaker.allow("a") and not breaker.allow("a")  # exactly one probe
    breaker.failure("a")
    assert breaker.state("a") == OPEN
    clock.now = 10.0
    assert breaker.allow("a")
    breaker.success("a")
    assert breaker.state("a") == CLOSED and breaker.allow("a")


def test_a_probe_that_never_reports_expires_so_the_breaker_cannot_stick_half_open() -> None:
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=5, clock=clock)
    breaker.failure("a")
    clock.now = 5.0
    assert breaker.allow("a")  # the probe was let through, but the request went elsewhere: no outcome comes
    clock.now = 9.0
    assert not breaker.allow("a")
    clock.now = 10.0
    assert breaker.allow("a")  # the unanswered probe expired: another caller probes
    breaker.success("a")
    assert breaker.state("a") == CLOSED


def test_token_bucket() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=2, burst=2, clock=clock)
    assert bucket.take() == 0 and bucket.take() == 0
    assert bucket.take() == pytest.approx(0.5)
    clock.now = 0.5
    assert bucket.take() == 0
    assert TokenBucket.retry_after(0.2) == 1 and TokenBucket.retry_after(2.1) == 3
    bucket.spend(5)  # whatever is left: into debt, repaid at the rate
    assert bucket.available() == pytest.approx(-5)
    clock.now = 3.0
    assert bucket.available() == pytest.approx(0)
    bucket.retune(rate=10, burst=4)  # saved up at the old rate, filled at the new one from now on
    clock.now = 4.0
    assert bucket.available() == pytest.approx(4)


def test_link_monitor_degrades_and_probes() -> None:
    clock = Clock()
    link = LinkMonitor(degrade_p99_ms=50, success_rate_threshold=0.99, window_s=60, probe_every=3, clock=clock)
    for _ in range(4):
        link.record(True, 500)
    assert not link.health().degraded  # too few samples to judge
    link.record(True, 500)
    health = link.health()
    assert health.degraded and "P99" in health.reason
    assert [link.allow_remote()[0] for _ in range(6)] == [True, False, True, False, False, True]  # a probe at once
    clock.now = 100.0  # old samples leave the window
    for _ in range(10):
        link.record(True, 5)
    assert not link.health().degraded
    for _ in range(2):
        link.record(False)
    assert "success rate" in link.health().reason


def test_a_degraded_link_probes_on_time_and_recovers_after_healthy_probes() -> None:
    clock = Clock()
    link = LinkMonitor(degrade_p99_ms=50, success_rate_threshold=0.99, window_s=60, probe_every=1000,
                       probe_interval_s=2.0, recover_after=3, clock=clock)
    for _ in range(10):
        link.record(False)
    assert link.health().degraded
    assert [link.allow_remote()[0] for _ in range(5)] == [True, False, False, False, False]
    clock.now += 2.0
    assert link.allow_remote()[0] and not link.allow_remote()[0]  # one probe per interval, whatever the traffic
    link.record(True, 5)
    link.record(True, 500)  # slow: not healthy, the count starts again
    link.record(True, 5)
    link.record(True, 5)
    assert link.health().degraded
    link.record(True, 5)  # three healthy outcomes in a row: the failures before them are forgotten
    health = link.health()
    assert not health.degraded and health.samples == 3
    assert link.allow_remote() == (True, "not enough samples")


def test_prefill_speed_interpolates_and_learns() -> None:
    speed = PrefillSpeed([(1000, 1.0), (3000, 4.5)])
    assert speed.seconds(1000) == pytest.approx(1.0)
    assert speed.seconds(2000) == pytest.approx(2000 * 0.00125)
    assert speed.seconds(6000) == pytest.approx(6000 * 0.0015)
    online = PrefillSpeed()
    online.observe(100, 1.0)
    assert online.seconds(50) == pytest.approx(0.5)


def test_one_stalled_prefill_does_not_move_the_learnt_speed() -> None:
    """In a two-decode deployment on two cores one local prefill of six took 224 ms against about 9 ms."""
    online = PrefillSpeed()
    for seconds in (0.009, 0.010, 0.224, 0.009, 0.011):
        online.observe(100, seconds)
    assert online.seconds(100) == pytest.approx(0.010)
    for _ in range(WINDOW):
        online.observe(100, 0.2)  # a lasting change is learnt within a window
    assert online.seconds(100) == pytest.approx(0.2)


def test_decode_instances_of_one_pool_share_their_local_speed() -> None:
    estimator, fp = Estimator(), Fingerprint("m", "llama", "w1", "t1", "float32", 2048)
    a, b = inst("a", fp=fp.to_wire()), inst("b", fp=fp.to_wire())
    other = inst("c", fp=dataclasses.replace(fp, dtype="bfloat16").to_wire())
    estimator.local_speed(a).observe(100, 1.0)
    assert estimator.local_speed(b).seconds(100) == pytest.approx(1.0)
    assert estimator.local_speed(other).online is None and estimator.local_speed(inst("d")).online is None


def test_decode_placement_filters_and_prefers_short_queues() -> None:
    rng = random.Random(0)
    pool = [inst("a", queue=3), inst("b", queue=1), inst("c", queue=0, free=10), inst("d", queue=9)]
    fits = decode_candidates(pool, need_kv_bytes=100, queue_limit=5, allow=lambda i: i != "b")
    assert [i.instance_id for i in fits] == ["a"]
    assert pick_decode([inst("a", queue=3), inst("b", queue=1)], rng).instance_id == "b"
    assert pick_decode([], rng) is None
    # power of two choices never picks the worst of three
    picks = {pick_decode([inst("x", queue=0), inst("y", queue=1), inst("z", queue=5)], rng).instance_id
             for _ in range(50)}
    assert "z" not in picks


def test_prefill_placement_by_expected_wait() -> None:
    speeds = {"fast": PrefillSpeed([(1000, 0.5)]), "slow": PrefillSpeed([(1000, 2.0)])}
    # expected time to finish this prompt = (queue depth + 1) × the instance's prefill time for the length
    pool = [inst("fast", "prefill", queue=4), inst("slow", "prefill", queue=0)]
    assert pick_prefill(pool, 1000, speeds, lambda i: True).instance_id == "slow"  # 2.5 s vs 2.0 s
    pool = [inst("fast", "prefill", queue=2), inst("slow", "prefill", queue=0)]
    assert pick_prefill(pool, 1000, speeds, lambda i: True).instance_id == "fast"  # 1.5 s vs 2.0 s
    assert pick_prefill(pool, 1000, speeds, lambda i: i != "fast").instance_id == "slow"


def test_routes() -> None:
    config = RouterConfig(offload_threshold_tokens=100)
    s = Scheduler(config, "relay", random.Random(0))
    prefill, relay = [inst("p", "prefill")], [inst("r", "relay")]
    assert s.route(100, prefill, relay).reason_code == "below_threshold"
    d = s.route(101, prefill, relay)
    assert (d.route, d.prefill.instance_id, d.relay.instance_id) == ("remote", "p", "r")
    assert s.route(500, [], relay).reason_code == "no_prefill"
    assert s.route(500, prefill, []).reason_code == "no_relay"
    assert Scheduler(config, "direct").route(500, prefill, []).route == "remote"
    for _ in range(10):
        s.links.get("", "").monitor.record(False)
    assert s.route(500, prefill, relay).route == "remote"  # the first one probes the link
    assert s.route(500, prefill, relay).reason_code == "link_degraded"
    strict = Scheduler(dataclasses.replace(config, fallback_local_prefill=False), "relay")
    with pytest.raises(KVUnavailable, match="fallback_local_prefill is off"):
        strict.route(500, [], relay)


def test_rate_limit_raises_429() -> None:
    s = Scheduler(RouterConfig(rate_limit_qps=1), "relay")
    s.admit()
    with pytest.raises(RateLimited) as info:
        s.admit()
    assert info.value.http_status == 429 and info.value.retry_after_s >= 1


def test_registry_refuses_other_models_and_ages_out() -> None:
    clock = Clock()
    registry = Registry(timeout_s=3, clock=clock)
    fp = {"model": "m", "arch": "llama", "weights": "a", "tokenizer": "t", "dtype": "float32", "max_seq_len": 8,
          "format_version": 1}
    registry.upsert(inst("d0", fp=fp))
    with pytest.raises(KVIncompatible, match="weights"):
        registry.upsert(inst("d1", fp={**fp, "weights": "b"}))
    assert [i.instance_id for i in registry.healthy("decode")] == ["d0"]
    clock.now = 3.5
    assert registry.healthy("decode") == []
