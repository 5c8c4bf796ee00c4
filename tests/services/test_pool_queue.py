"""The prefill pool's pieces inside one instance: the clusters' fair order of the engine queue (on the real engine
loop and the synthetic engine, whose prefill sleeps its modelled time), the quotas, and who may claim a cluster;
and the router's answer to a refusal over quota (on ``FakeInstances``, as test_dispatch_unit.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from prfaas.audit.report import entries
from prfaas.config import from_dict
from prfaas.engine import load_engine
from prfaas.errors import InvalidRequest, KVUnauthorized, PoolQuotaExceeded
from prfaas.events import PrefillDone, PrefillEvent
from prfaas.messages import PrefillRequest
from prfaas.scheduler.quota import QuotaHolds
from prfaas.services.fair_queue import FairQueue, FairSlots
from prfaas.services.fake_instances import PrefillScript
from prfaas.services.pool import PoolClients
from prfaas.services.prefill_scheduler import PrefillJob, PrefillScheduler
from prfaas.tenancy.clusters import Admission, ClusterGate, ClusterPolicy, parse_clusters, router_headers
from tests.clock import Clock
from tests.conftest import random_prompt
from tests.exactness import first_divergence_is_a_near_tie
from tests.services.test_dispatch_unit import complete, router

A, B = ClusterPolicy("a"), ClusterPolicy("b")


def _ends(jobs: list[tuple[ClusterPolicy, int]]) -> list[str]:
    """The clusters of ``jobs`` (cluster, prompt tokens; every one long enough to be chunked) in the order the
    engine loop finished them. They are submitted together while a first job, of a cluster of its own, holds the
    engine (in its ``on_layer``), so the order is the queue's alone."""
    engine = load_engine("synthetic-kimi-linear-48b")
    ends: list[str] = []
    done = threading.Event()

    def job(cluster: ClusterPolicy, n: int) -> PrefillJob:
        def finish(token: int | None, seconds: float, error: BaseException | None) -> None:
            assert error is None, error
            ends.append(cluster.name)
            if len(ends) == len(jobs) + 1:
                done.set()
        return PrefillJob(list(range(1, n + 1)), None, lambda state: None, finish, cluster)

    holding, release = threading.Event(), threading.Event()

    def hold(state: object) -> None:  # z's last pass, on the engine thread: it holds the engine until all are queued
        holding.set()
        assert release.wait(30)
    scheduler = PrefillScheduler(engine, max_batch=8, batch_tokens=2048, chunk_tokens=512)
    try:
        z = job(ClusterPolicy("z"), 16000)
        z.on_layer = hold
        scheduler.submit(z)
        assert holding.wait(30)
        for cluster, n in jobs:
            scheduler.submit(job(cluster, n))
        release.set()
        assert done.wait(60)
    finally:
        release.set()
        scheduler.close()
    assert scheduler.queue_depth == 0 and ends[0] == "z", ends
    return ends[1:]


def test_a_burst_of_one_cluster_does_not_hold_back_another_clusters_prompt() -> None:
    ends = _ends([*[(A, 1024)] * 10, (B, 1024)])  # arrival order: b's prompt is the last
    assert ends.index("b") <= 1, ends  # arrival order would finish it last


def test_shares_divide_prompt_tokens_not_requests() -> None:
    # b's prompts are three times as long: one of b's per three of a's (arrival order: a's nine first)
    ends = _ends([*[(A, 1000)] * 9, *[(B, 3000)] * 3])
    assert ends[:4].count("b") == 1 and ends[:8].count("b") == 2, ends
    # share 3 against 1: three times the tokens, so a's prompts three times as long alternate with b's
    ends = _ends([*[(ClusterPolicy("a", share=3), 3000)] * 4, *[(B, 1000)] * 4])
    assert ends == ["a", "b"] * 4, ends


def test_a_higher_priority_class_goes_first() -> None:
    ends = _ends([*[(A, 1000)] * 4, *[(B, 1000)] * 4, (ClusterPolicy("u", priority=1), 1000)])
    assert ends[0] == "u", ends


class _Passes:
    """The forward passes of the tiny engine's model, as (prompt's name, tokens), in the order they ran; and the
    first token of each prompt the loop finished. A prompt named ``z`` holds the engine in its last pass (its
    ``on_layer``) until ``release`` is set, so the prompts submitted meanwhile are queued together."""

    def __init__(self, engine: Any, prompts: dict[str, list[int]], chunk: int) -> None:
        self.engine, self.prompts = engine, prompts
        self.ran: list[tuple[str, int]] = []
        self.tokens: dict[str, int] = {}
        self.holding, self.release, self.done = threading.Event(), threading.Event(), threading.Event()
        self.scheduler = PrefillScheduler(engine, max_batch=8, batch_tokens=chunk, chunk_tokens=chunk)
        self._hook = engine.model.register_forward_pre_hook(self._seen, with_kwargs=True)

        self._arrival: tuple[tuple[str, int], str, ClusterPolicy] | None = None

    def arrive_during(self, nth_pass: tuple[str, int], name: str, cluster: ClusterPolicy) -> None:
        """Submit ``name`` from the engine thread as the ``nth_pass`` (prompt's name, pass number from 1) starts."""
        self._arrival = (nth_pass, name, cluster)

    def _seen(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids, at = kwargs["input_ids"][0].tolist(), int(kwargs["position_ids"][0, 0])
        name = next(name for name, p in self.prompts.items() if p[at:at + len(ids)] == ids)
        self.ran.append((name, len(ids)))
        if self._arrival and self._arrival[0] == (name, sum(1 for n, _ in self.ran if n == name)):
            self.submit(*self._arrival[1:])

    def submit(self, name: str, cluster: ClusterPolicy) -> None:
        def on_layer(state: object) -> None:
            if name == "z":
                self.holding.set()
                assert self.release.wait(30)

        def finish(token: int | None, seconds: float, error: BaseException | None) -> None:
            assert error is None, error
            self.tokens[name] = token  # type: ignore[assignment]
            if len(self.tokens) == len(self.prompts):
                self.done.set()
        self.scheduler.submit(PrefillJob(self.prompts[name], None, on_layer, finish, cluster))

    def close(self) -> None:
        self.scheduler.close()
        self._hook.remove()
        assert self.scheduler.queue_depth == 0 and not self.scheduler._parts

    def first_tokens_are_greedy(self) -> None:
        for name, prompt in self.prompts.items():
            got, ref = [self.tokens[name]], self.engine.generate(prompt, 1)
            assert got == ref or first_divergence_is_a_near_tie(self.engine, prompt, got, ref), name


def test_a_lone_long_prompt_runs_in_one_pass(engines: Any) -> None:
    engine = engines("tiny-llama")
    passes = _Passes(engine, {"a": random_prompt(128, seed=1, vocab=engine.vocab_size)}, chunk=16)
    try:
        passes.submit("a", A)
        assert passes.done.wait(60)
    finally:
        passes.close()
    assert passes.ran == [("a", 128)]  # not eight passes of 16: nothing else waited
    passes.first_tokens_are_greedy()


def test_an_under_share_clusters_prompt_takes_the_next_pass_of_a_long_one_in_service(engines: Any) -> None:
    engine = engines("tiny-llama")
    prompts = {name: random_prompt(n, seed=i, vocab=engine.vocab_size)
               for i, (name, n) in enumerate([("z", 64), ("a1", 128), ("a2", 64), ("b", 64)])}
    passes = _Passes(engine, prompts, chunk=16)
    passes.arrive_during(("a1", 2), "b", B)  # b's prompt arrives while a1's second pass runs
    try:
        passes.submit("z", ClusterPolicy("z"))
        assert passes.holding.wait(30)  # z is alone: one pass, in which it holds the engine
        passes.submit("a1", A)
        passes.submit("a2", A)
        passes.release.set()
        assert passes.done.wait(60)
    finally:
        passes.release.set()
        passes.close()
    # a1 is cut (a2 waits); b, idle until now, ranks ahead of a1's rest and takes the next pass, and runs to its end;
    # then a1's rest, still cut (a2 waits), and a2, alone at last, in one pass
    assert passes.ran == [("z", 64), ("a1", 16), ("a1", 16), *[("b", 16)] * 4, *[("a1", 16)] * 6, ("a2", 64)]
    passes.first_tokens_are_greedy()


def test_a_lagging_cluster_keeps_up_to_one_prompt_of_credit() -> None:
    queue: FairQueue[str] = FairQueue()
    for name in ("a0", "a1", "a2"):
        queue.push(name, A, 1000)  # finish tags 1000, 2000, 3000
    queue.take("a0")
    queue.take("a1")
    queue.serve("a2")  # a2's first pass: the virtual time is its start tag, 2000
    queue.push("b0", B, 1500)  # b lags by 2000 ≥ 1500: finishes at V, ahead of the rest of a2
    queue.push("b1", B, 100)  # tagged as usual from b0 (2100): still ahead of a2's 3000
    queue.push("b2", B, 1000)  # 3100: the credit is spent
    assert list(queue.ordered()) == ["b0", "b1", "a2", "b2"]


def test_fair_queue_tags_restart_for_an_idle_cluster() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(5):
        queue.push(f"a{i}", A, 100)
    queue.take(next(queue.ordered()))
    queue.push("b0", B, 100)  # b was idle: it starts at the virtual time, not at 0 and not behind a's backlog
    assert list(queue.ordered())[:2] == ["b0", "a1"]
    assert len(queue) == 5


def test_quota_of_prompt_tokens_in_flight() -> None:
    capped = ClusterPolicy("a", max_inflight_tokens=1000)
    admission = Admission()
    admission.admit(capped, 2000)  # alone, a prompt over the cap is let in: it would never fit otherwise
    with pytest.raises(PoolQuotaExceeded) as refused:
        admission.admit(capped, 10)
    assert refused.value.http_status == 429 and refused.value.code == "POOL_QUOTA_EXCEEDED"
    admission.admit(B, 10**6)  # another cluster is not affected
    admission.release(capped, 2000)
    admission.admit(capped, 600)
    admission.admit(capped, 400)
    assert admission.inflight("a") == 1000


def test_quota_of_prompt_tokens_per_second() -> None:
    now = [0.0]
    admission = Admission(clock=lambda: now[0])
    rated = ClusterPolicy("a", tokens_per_s=100)
    admission.admit(rated, 300)  # from a full bucket, into debt
    admission.release(rated, 300)
    with pytest.raises(PoolQuotaExceeded) as refused:
        admission.admit(rated, 50)
    assert refused.value.retry_after_s == 3  # (100 - -200) / 100 per second
    now[0] = 3.0
    admission.admit(rated, 50)


def test_a_cluster_proves_its_name_by_key_or_router_certificate() -> None:
    clusters = parse_clusters({"east": {"key": "e" * 20}, "west": {"key": "w" * 20, "share": 2}})
    gate = ClusterGate(clusters)
    assert gate.identify("east", "Bearer " + "e" * 20, None, "").name == "east"
    assert gate.identify("west", "", "router", "west-1").share == 2
    for claim, auth, role, name in [("east", "Bearer " + "w" * 20, None, ""), ("east", "", "router", "west"),
                                    ("east", "", "decode", "east"), ("north", "Bearer " + "e" * 20, None, ""),
                                    ("", "", None, "")]:
        with pytest.raises(KVUnauthorized):
            gate.identify(claim, auth, role, name)
    assert ClusterGate({}).identify("", "", None, "").name == "default"  # a pool without clients: as before
    assert router_headers(clusters, "west") == {"x-prfaas-cluster": "west", "authorization": "Bearer " + "w" * 20}


@pytest.mark.parametrize("spec", [{"east": {"key": "short"}}, {"East": {}}, {"east": {"share": 0}},
                                  {"east": {"color": 1}}, {"a": {"key": "k" * 16}, "b": {"key": "k" * 16}},
                                  {"east": {"share": True}}])
def test_bad_cluster_entries_are_refused(spec: dict) -> None:
    with pytest.raises(InvalidRequest):
        parse_clusters(spec)


def _held_router(prefills: int = 1, **config: Any) -> tuple[Any, Any, Clock]:
    r, fake = router(prefills=prefills, **config)
    clock = Clock(100.0)
    r.scheduler.quota = QuotaHolds(clock)
    return r, fake, clock


def test_the_router_prefills_locally_over_quota_and_keeps_the_instance_in_service() -> None:
    r, fake, clock = _held_router()
    fake.prefills["p0"] = PrefillScript(refuse=PoolQuotaExceeded("cluster east is over its quota", retry_after_s=2))
    meta = complete(r)["prfaas"]  # asked, refused: fell back
    assert (meta["route"], meta["reason_code"], meta["fallback"]) == ("local", "pool_quota", True), meta
    assert "POOL_QUOTA_EXCEEDED" in meta["reason"]
    for _ in range(3):  # within its Retry-After: local at once, not asked (a breaker would open after three)
        meta = complete(r)["prfaas"]
        assert (meta["route"], meta["reason_code"], meta["fallback"]) == ("local", "pool_quota", False), meta
        assert "remembered Retry-After" in meta["reason"]
    assert r.scheduler.breakers.state("p0") == "closed" and fake.blobs == {}
    assert len(fake.calls_to("prefill")) == 1
    clock.now += 1.0  # the stream's Failed event carries no Retry-After: the default, 1 s, has passed
    assert complete(r)["prfaas"]["fallback"] is True and len(fake.calls_to("prefill")) == 2  # asked again


def test_a_quota_hold_is_per_prefill_instance_and_cluster() -> None:
    r, fake, clock = _held_router(prefills=2)
    fake.prefills["p0"] = PrefillScript(refuse=PoolQuotaExceeded("over quota here", retry_after_s=5))
    r.scheduler.quota.hold("p0", r.scheduler.cluster, 5)
    r.scheduler.quota.hold("p1", "another-cluster", 5)  # another cluster's refusal says nothing of this one
    for _ in range(3):
        meta = complete(r)["prfaas"]
        assert (meta["route"], meta["prefill_instance"]) == ("remote", "p1"), meta
    assert not fake.calls_to("prefill", "p0") and len(fake.calls_to("prefill", "p1")) == 3
    assert r.scheduler.quota.remaining("p0", r.scheduler.cluster) == 5.0
    clock.now += 5.0
    assert r.scheduler.quota.remaining("p0", r.scheduler.cluster) == 0.0


def test_a_quota_hold_without_fallback_is_a_429_with_the_time_left() -> None:
    r, fake, clock = _held_router(fallback_local_prefill=False)
    r.scheduler.quota.hold("p0", r.scheduler.cluster, 3)
    clock.now += 0.5
    with pytest.raises(PoolQuotaExceeded) as caught:
        complete(r)
    assert caught.value.retry_after_s == 3 and not fake.calls_to("prefill")


def test_a_freed_transfer_slot_goes_to_the_cluster_holding_fewer() -> None:
    async def scenario() -> list[str]:
        slots, order = FairSlots(2), []
        release = {name: asyncio.Event() for name in ("a0", "a1", "a2", "a3", "b0")}

        async def hold(name: str, cluster: ClusterPolicy) -> None:
            async with slots.slot(cluster):
                order.append(name)
                await release[name].wait()

        tasks = [asyncio.create_task(hold(f"a{i}", A)) for i in range(4)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(hold("b0", B)))  # arrives after a's burst filled both slots and queued
        cancelled = asyncio.create_task(hold("gone", B))
        await asyncio.sleep(0.01)
        cancelled.cancel()  # a waiter that leaves takes nothing with it
        release["a0"].set()
        await asyncio.sleep(0.01)
        for event in release.values():
            event.set()
        await asyncio.gather(*tasks)
        await asyncio.gather(cancelled, return_exceptions=True)
        assert slots.free == 2 and slots.held("a") == slots.held("b") == 0
        return order

    order = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert order[:3] == ["a0", "a1", "b0"], order  # arrival order would give a2 the freed slot


def test_the_quota_is_given_back_when_a_stream_ends_or_is_dropped_unread(tmp_path: Path) -> None:
    config = from_dict({"audit_log": str(tmp_path / "{instance}.audit"),
                        "clusters": {"east": {"key": "e" * 20, "max_inflight_tokens": 10}}})
    pool = PoolClients(config, "prefill-0")
    east = pool.clusters["east"]
    request = PrefillRequest(request_id="r", kv_id="0123456789ab-1-aaaaaaaaaaaaaaaaaaaa", token_ids=[1] * 8)

    async def events() -> AsyncIterator[PrefillEvent]:
        yield PrefillDone(first_token=1, kv_bytes=100, chunks=1, prefill_ms=5.0, queue_ms=1.0)

    async def read(stream: AsyncIterator[PrefillEvent]) -> list[PrefillEvent]:
        return [event async for event in stream]

    stream = pool.admitted(east, request, events())
    with pytest.raises(PoolQuotaExceeded):  # 8 in flight: 8 more is over the cap of 10
        pool.admitted(east, request, events())
    assert len(asyncio.run(read(stream))) == 1 and pool.admission.inflight("east") == 0
    unread = pool.admitted(east, request, events())  # the router left before the response started
    assert pool.admission.inflight("east") == 8
    del unread
    assert pool.admission.inflight("east") == 0
    pool.close()
    written = [e for e in entries([tmp_path / "prefill-0-pool.audit"]) if e.get("kind") == "pool"]
    assert [(e["cluster"], e["status"], e["prompt_tokens"], e["kv_bytes"]) for e in written] == [
        ("east", "POOL_QUOTA_EXCEEDED", 8, 0), ("east", "ok", 8, 100)]  # the unread stream used nothing
