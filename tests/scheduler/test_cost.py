"""The online cost model on synthetic states: queues, bandwidth, bytes in flight (no sockets: ``Scheduler.route``
is pure over instance snapshots)."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest

from prfaas.config import RouterConfig
from prfaas.errors import InvalidRequest
from prfaas.messages import InstanceInfo
from prfaas.scheduler import Decision, Scheduler
from prfaas.scheduler.codecs import parse_codecs
from prfaas.scheduler.cost import Inputs, LinkView, decide, exposed_s
from prfaas.tenancy.policy import TenantPolicy
from tests.clock import Clock

MIB = 2**20
GBIT = 1e9



def test_exposed_transfer_is_the_last_chunk_on_an_idle_fast_link() -> None:
    link = LinkView(bandwidth_bps=100 * GBIT, chunk_bytes=4 * MIB)
    assert exposed_s(400 * MIB, 0.0, 1.0, link) == pytest.approx(4 * MIB * 8 / (100 * GBIT))


def test_bytes_in_flight_and_a_slow_link_expose_the_backlog() -> None:
    idle = LinkView(bandwidth_bps=10 * GBIT, chunk_bytes=4 * MIB)
    busy = LinkView(bandwidth_bps=10 * GBIT, inflight_bytes=2000 * MIB, chunk_bytes=4 * MIB)
    kv = 400 * MIB
    rate = 10 * GBIT / 8
    assert exposed_s(kv, 0.0, 1.0, idle) == pytest.approx(4 * MIB / rate)  # 0.34 s to send, 1 s to compute
    assert exposed_s(kv, 0.0, 1.0, busy) == pytest.approx((2000 + 400) * MIB / rate - 1.0)
    # a queue wait before the prefill lets the link drain what is ahead
    assert exposed_s(kv, 2.0, 1.0, busy) < exposed_s(kv, 0.0, 1.0, busy)
    assert exposed_s(kv, 0.0, 1.0, LinkView(bandwidth_bps=1 * GBIT)) == pytest.approx(kv / (GBIT / 8) - 1.0)


def test_the_deciding_term_is_named() -> None:
    fast = LinkView(bandwidth_bps=100 * GBIT)
    slow_local = decide(Inputs(100 * MIB, 0.0, 1.0, 0.0, 0.0, 3.0), fast)
    assert (slow_local.route, slow_local.code) == ("remote", "cost_prefill")
    busy_local = decide(Inputs(100 * MIB, 0.0, 1.0, 0.0, 10.0, 1.0), fast)
    assert (busy_local.route, busy_local.code) == ("remote", "cost_queue")
    busy_pool = decide(Inputs(100 * MIB, 10.0, 1.0, 0.0, 0.0, 3.0), fast)
    assert (busy_pool.route, busy_pool.code) == ("local", "cost_queue")
    thin_link = decide(Inputs(1000 * MIB, 0.0, 1.0, 0.0, 0.0, 1.5), LinkView(bandwidth_bps=1 * GBIT))
    assert (thin_link.route, thin_link.code) == ("local", "cost_transfer")
    assert "predicted TTFT remote" in thin_link.explain()


def inst(name: str, role: str, dc: str, queue: int = 0) -> InstanceInfo:
    return InstanceInfo(instance_id=name, role=role, url=f"http://{name}", kv_address=f"{name}:1", datacenter=dc,
                        free_kv_bytes=10**12, kv_budget_bytes=10**12, queue_depth=queue,
                        kv_bytes_per_token=10_000, kv_fixed_bytes=0)


def profiles(tmp_path: Path, remote_s_per_token: float = 0.0001, local_slowdown: float = 3.0) -> tuple[str, str]:
    """Speed profiles in the ``prfaas measure`` format: local prefill ``local_slowdown`` × slower."""
    paths = []
    for name, rate in (("remote", remote_s_per_token), ("local", remote_s_per_token * local_slowdown)):
        path = tmp_path / f"{name}.json"
        rows = [{"seq_len": n, "seconds": n * rate} for n in (1024, 8192, 32768)]
        kv = [{"seq_len": 8192, "codec": "none", "bytes": 8192 * 10_000},
              {"seq_len": 8192, "codec": "int8", "bytes": 8192 * 2_500}]
        path.write_text(json.dumps({"model": "m", "prefill": rows, "decode": [], "kv": kv}))
        paths.append(str(path))
    return paths[0], paths[1]


def cost_scheduler(tmp_path: Path, clock: Clock, **changes: Any) -> Scheduler:
    remote, local = profiles(tmp_path)
    config = RouterConfig(offload_policy="cost", offload_threshold_tokens=0, link_bandwidth_bps=10 * GBIT,
                          prefill_profile=remote, local_profile=local)
    return Scheduler(dataclasses.replace(config, **changes), "direct", random.Random(0), chunk_bytes=4 * MIB,
                     clock=clock)


def test_a_threshold_of_zero_on_a_healthy_idle_link_still_routes_remote_where_remote_is_faster(
        tmp_path: Path) -> None:
    s = cost_scheduler(tmp_path, Clock())
    d = s.route(8192, [inst("p", "prefill", "dc-a")], [], decode=inst("d", "decode", "dc-b"), home="dc-b")
    assert (d.route, d.reason_code, d.link) == ("remote", "cost_prefill", ("dc-a", "dc-b"))
    assert d.kv_bytes == 8192 * 10_000


def test_the_floor_still_keeps_short_prompts_local(tmp_path: Path) -> None:
    s = cost_scheduler(tmp_path, Clock(), offload_threshold_tokens=4096)
    d = s.route(4096, [inst("p", "prefill", "dc-a")], [], decode=inst("d", "decode", "dc-b"), home="dc-b")
    assert d.reason_code == "below_threshold"


def test_queues_decide_both_ways(tmp_path: Path) -> None:
    s = cost_scheduler(tmp_path, Clock())
    prefill, decode = inst("p", "prefill", "dc-a"), inst("d", "decode", "dc-b")
    busy_pool = inst("p", "prefill", "dc-a", queue=20)  # heartbeat: 20 prompts queued at the pool
    d = s.route(8192, [busy_pool], [], decode=decode, home="dc-b")
    assert (d.route, d.reason_code) == ("local", "cost_queue")
    # the router's own backlog on the decode instance: local prefills it sent and that have not started decoding
    tickets = [s.begin(Decision("local", "cost_queue", ""), decode, 8192) for _ in range(8)]
    d = s.route(8192, [busy_pool], [], decode=decode, home="dc-b")
    assert (d.route, d.reason_code) == ("remote", "cost_queue")
    for ticket in tickets:
        ticket.close()
        ticket.close()  # idempotent: every path that ends a request may close its ticket
    assert s.estimator.backlog.seconds("d") == pytest.approx(0.0)
    assert s.route(8192, [prefill], [], decode=decode, home="dc-b").route == "remote"


def test_bytes_in_flight_on_a_link_raise_the_remote_cost(tmp_path: Path) -> None:
    clock = Clock()
    s = cost_scheduler(tmp_path, clock, link_bandwidth_bps=2 * GBIT, link_share=1.0)
    prefill, decode = inst("p", "prefill", "dc-a"), inst("d", "decode", "dc-b")
    assert s.route(8192, [prefill], [], decode=decode, home="dc-b").route == "remote"
    s.links.get("dc-a", "dc-b").send(800 * MIB)  # another request's KV still crossing
    d = s.route(8192, [prefill], [], decode=decode, home="dc-b")
    assert (d.route, d.reason_code) == ("local", "cost_transfer")
    s.links.get("dc-a", "dc-b").delivered(800 * MIB)
    assert s.route(8192, [prefill], [], decode=decode, home="dc-b").route == "remote"


def test_the_link_takes_requests_while_its_byte_bucket_is_not_in_debt(tmp_path: Path) -> None:
    clock = Clock()
    s = cost_scheduler(tmp_path, clock, link_bandwidth_bps=1 * GBIT, link_share=0.7)
    prefill, decode = inst("p", "prefill", "dc-a"), inst("d", "decode", "dc-b")
    bucket = 0.7 * 1 * GBIT / 8 * 10  # bytes: link_share × bandwidth, ten seconds of it saved up
    routed = 0.0
    while routed < bucket:  # the last one goes although its bytes leave the bucket in debt
        d = s.route(8192, [prefill], [], decode=decode, home="dc-b")
        assert d.route == "remote"
        s.begin(d, decode, 8192).close()  # delivered at once: only the link's budget is left to decide
        routed += d.kv_bytes
    assert routed - bucket < 8192 * 10_000
    d = s.route(8192, [prefill], [], decode=decode, home="dc-b")
    assert (d.route, d.reason_code) == ("local", "link_busy")
    assert "no room" in d.reason
    clock.now = (routed - bucket) / (0.7 * 1 * GBIT / 8) - 0.01  # the debt is not repaid yet
    assert s.route(8192, [prefill], [], decode=decode, home="dc-b").route == "local"
    clock.now += 0.02
    assert s.route(8192, [prefill], [], decode=decode, home="dc-b").route == "remote"


def test_when_the_link_is_short_the_prompts_that_save_least_per_byte_stay_local(tmp_path: Path) -> None:
    clock = Clock()
    s = cost_scheduler(tmp_path, clock, link_bandwidth_bps=1 * GBIT, link_share=0.7)
    prefill = inst("p", "prefill", "dc-a")
    decode = dataclasses.replace(inst("d", "decode", "dc-b"), kv_fixed_bytes=20_000_000)  # a hybrid's state
    for _ in range(8):  # the decode instance is busy with local prefills: every prompt would rather go remote
        s.begin(Decision("local", "cost_queue", ""), decode, 8192)
    routes: dict[int, list[str]] = {512: [], 6144: []}
    for i in range(1200):  # a long and a short prompt every second for ten minutes, KV delivered at once
        clock.now = i / 2
        n = 512 if i % 2 else 6144
        d = s.route(n, [prefill], [], decode=decode, home="dc-b")
        routes[n].append(d.route)
        if d.route == "remote":
            s.begin(d, decode, n).close()
    # the long ones ask 0.65 of the link, the short ones 0.20 more, mostly the fixed part: the short ones yield
    long, short = routes[6144][120:], routes[512][120:]
    assert long.count("remote") >= 0.95 * len(long)
    assert short.count("remote") <= 0.5 * len(short)


def test_the_codec_shrinks_the_predicted_kv(tmp_path: Path) -> None:
    s = cost_scheduler(tmp_path, Clock())
    prefill, decode = inst("p", "prefill", "dc-a"), inst("d", "decode", "dc-b")
    plain = s.route(8192, [prefill], [], decode=decode, home="dc-b")
    int8 = s.route(8192, [prefill], [], decode=decode, home="dc-b", codec="int8")
    assert int8.kv_bytes == pytest.approx(plain.kv_bytes / 4)  # the profile's int8 row is a quarter of none's


def test_a_bad_link_degrades_that_link_only(tmp_path: Path) -> None:
    s = cost_scheduler(tmp_path, Clock())
    prefill = inst("p", "prefill", "dc-a")
    for _ in range(20):
        s.links.get("dc-a", "dc-b").monitor.record(ok=False)
    s.route(8192, [prefill], [], decode=inst("d", "decode", "dc-b"), home="dc-b")  # the probe goes through
    d = s.route(8192, [prefill], [], decode=inst("d", "decode", "dc-b"), home="dc-b")
    assert (d.route, d.reason_code) == ("local", "link_degraded")
    other = s.route(8192, [prefill], [], decode=inst("e", "decode", "dc-c"), home="dc-c")
    assert (other.route, other.link) == ("remote", ("dc-a", "dc-c"))


def test_the_threshold_policy_is_unchanged_by_the_cost_inputs(tmp_path: Path) -> None:
    remote, local = profiles(tmp_path, local_slowdown=0.5)  # local faster: the cost model would say local
    s = Scheduler(RouterConfig(offload_threshold_tokens=0, prefill_profile=remote, local_profile=local), "direct")
    d = s.route(8192, [inst("p", "prefill", "dc-a")], [], decode=inst("d", "decode", "dc-b"), home="dc-b")
    assert (d.route, d.reason_code) == ("remote", "over_threshold")


ADAPTIVE = {"min_agreement": 0.99, "agreement": {"m": {"int8": 0.995, "fp8": 0.994, "int4": 0.97}},
            "tenants": {"default": ["int4", "fp8", "int8"], "strict": []}}


def test_adaptive_codecs_are_off_by_default_and_refused_when_malformed() -> None:
    assert Scheduler(RouterConfig(), "direct").codecs is None
    policy = parse_codecs(ADAPTIVE)
    assert policy is not None
    assert policy.allowed("default", "m") == [("int8", 0.995), ("fp8", 0.994)]  # int4 is under the floor
    assert policy.allowed("strict", "m") == [] and policy.allowed("default", "other-model") == []
    malformed: list[dict[str, Any]] = [{"agreement": {"m": {"zip": 1.0}}}, {"min_agreement": 2}, {"codecs": []}]
    for bad in malformed:
        with pytest.raises(InvalidRequest, match="adaptive_codec"):
            parse_codecs(bad)


def test_a_link_bound_request_goes_remote_with_a_lossy_codec_when_allowed(tmp_path: Path) -> None:
    decode = dataclasses.replace(inst("d", "decode", "dc-b"), model="m")
    prefill = inst("p", "prefill", "dc-a")
    thin = {"link_bandwidth_bps": 0.25 * GBIT, "link_share": 1.0}
    plain = cost_scheduler(tmp_path, Clock(), **thin).route(8192, [prefill], [], decode=decode, home="dc-b")
    assert (plain.route, plain.reason_code, plain.codec) == ("local", "cost_transfer", "")
    s = cost_scheduler(tmp_path, Clock(), adaptive_codec=ADAPTIVE, **thin)
    d = s.route(8192, [prefill], [], decode=decode, home="dc-b")
    assert (d.route, d.reason_code, d.codec, d.prefill) == ("remote", "link_codec", "int8", prefill)
    assert d.kv_bytes == pytest.approx(8192 * 2_500) and "measured agreement 99.5%" in d.reason
    strict = s.route(8192, [prefill], [], decode=decode, home="dc-b", tenant=TenantPolicy(name="strict"))
    assert (strict.route, strict.codec) == ("local", "")
    fast = cost_scheduler(tmp_path, Clock(), adaptive_codec=ADAPTIVE)  # compute-bound: no codec asked for
    d = fast.route(8192, [prefill], [], decode=decode, home="dc-b")
    assert (d.route, d.codec) == ("remote", "")


def test_a_suffix_blob_is_costed_by_the_bytes_decode_lacks(tmp_path: Path) -> None:
    # a chat's next turn: prefill and decode both hold its first 8,000 tokens; decode is busy with local prefills
    # and the link is thin (10 Mbit/s): the whole blob (78 MiB, ~65 s) would lose to local, its suffix (1.9 MB) wins
    from prfaas.kv import Fingerprint
    from prfaas.kv.prefix import block_hashes, pool_tenant, prefix_salt, summary_key
    from prfaas.scheduler.placement import PromptPrefix

    fp = Fingerprint("m", "llama", "w1", "t1", "float32", 16384)
    tokens = [100 + i % 5000 for i in range(8192)]

    def holding(name: str, role: str, dc: str, tenant: str) -> InstanceInfo:
        held = [summary_key(h) for h in reversed(block_hashes(tokens[:8000], prefix_salt(fp, tenant)))]
        return dataclasses.replace(inst(name, role, dc), fingerprint=fp.to_wire(), prefix_blocks=held[:512])

    s = cost_scheduler(tmp_path, Clock(), link_bandwidth_bps=0.01 * GBIT, link_share=1.0)
    prefill = holding("p", "prefill", "dc-a", pool_tenant(s.cluster, "acme"))
    decode = holding("d", "decode", "dc-b", "acme")
    for _ in range(8):
        s.begin(Decision("local", "cost_queue", ""), decode, 8192)
    d = s.route(8192, [prefill], [], decode=decode, home="dc-b", prompt=PromptPrefix(tokens, "acme", s.cluster))
    assert d.route == "remote" and d.kv_bytes == (8192 - 8000) * 10_000
    whole = s.route(8192, [inst("p", "prefill", "dc-a")], [], decode=inst("d", "decode", "dc-b"), home="dc-b")
    assert (whole.route, whole.reason_code) == ("local", "cost_transfer")
