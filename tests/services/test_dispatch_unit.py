"""The router's rules on ``FakeInstances`` (no processes, no sockets): routing by threshold, link health and
breakers, fallback to local prefill, resume after a decode death, queueing, tenancy, the ``prfaas`` field.
The multi-process tests (test_lifecycle.py, test_faults.py) prove the same paths over real HTTP and data planes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from prfaas.config import from_dict
from prfaas.errors import InvalidRequest, KVStoreFull, KVUnavailable, RateLimited
from prfaas.events import Done, Token
from prfaas.messages import GenerateRequest, PrefillRequest, SamplingParams
from prfaas.services.dispatch import Job
from prfaas.services.fake_instances import DecodeScript, FakeInstances, PrefillScript, token_at
from prfaas.services.router import Router

pytestmark = pytest.mark.timeout(30)
T = TypeVar("T")
THRESHOLD = 8
LONG = " ".join(["word"] * 20)  # 20 tokens for the fake tokenizer: over the threshold
SHORT = "a b c"


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 10))


def router(mode: str = "relay", decodes: int = 1, prefills: int = 1, **config: Any) -> tuple[Router, FakeInstances]:
    fake = FakeInstances()
    r = Router(from_dict({"offload_threshold_tokens": THRESHOLD, **config}), mode, instances=fake)
    for i in range(decodes):
        r.registry.upsert(fake.info("decode", f"d{i}"))
    for i in range(prefills):
        r.registry.upsert(fake.info("prefill", f"p{i}", datacenter="dc-a"))
    if mode == "relay":
        r.registry.upsert(fake.info("relay", "r0"))
    return r, fake


def complete(r: Router, prompt: str = LONG, tenant: str = "default", **body: Any) -> dict[str, Any]:
    reply = run(r.complete({"model": r.model_name, "prompt": prompt, "max_tokens": 4, **body}, chat=False,
                           tenant=tenant))
    assert isinstance(reply, dict)
    return reply


def tokens_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def test_a_prompt_within_the_threshold_is_prefilled_locally() -> None:
    r, fake = router()
    reply = complete(r, SHORT)
    meta = reply["prfaas"]
    assert (meta["route"], meta["reason_code"], meta["decode_instance"]) == ("local", "below_threshold", "d0")
    assert not fake.calls_to("prefill")
    [pull] = fake.calls_to("generate")
    assert pull.kv_id == "" and pull.token_ids == [2, 2, 2]
    assert tokens_of(reply["choices"][0]["text"]) == [token_at(s) for s in range(4)]
    assert "kv_id" not in meta and meta["fallback"] is False and meta["retries"] == 0


def test_a_long_prompt_is_prefilled_remotely_through_the_relay_and_reported() -> None:
    r, fake = router()
    reply = complete(r)
    meta = reply["prfaas"]
    [body] = fake.calls_to("prefill", "p0")
    [pull] = fake.calls_to("generate", "d0")
    assert isinstance(body, PrefillRequest) and isinstance(pull, GenerateRequest)
    assert meta["route"] == "remote" and meta["kv_id"] == body.kv_id == pull.kv_id
    assert body.push_to == pull.kv_address == "r0:1"  # relay mode: pushed to the relay, pulled from it
    assert isinstance(body.sampling, SamplingParams) and body.sampling == pull.sampling
    assert meta["prefill_instance"] == "p0" and meta["kv_bytes"] == 64 * 20
    assert meta["stages"] == {"queue_ms": 1.0, "prefill_ms": 5.0, "transfer_ms": 3.0, "restore_ms": 1.0}
    assert meta["transfer_ms"] == 3.0 and meta["ttft_ms"] >= 0 and meta["tenant"] == "default"
    assert tokens_of(reply["choices"][0]["text"]) == [token_at(s) for s in range(4)]
    assert fake.blobs == {} and fake.released == []  # decode consumed it; the router had nothing to release
    assert r.scheduler.speeds["p0"]  # the prefill's time was learnt
    assert (pull.first_token, pull.kv_tokens) == (-1, 0)  # prfaas's engine: the first token is in the blob


@pytest.mark.parametrize("max_tokens", [4, 1])
def test_a_first_token_said_at_accepted_is_handed_to_decode(max_tokens: int) -> None:
    """A vLLM prefill says its first token at ``accepted``; the router passes it on, so decode streams it at once
    and computes from the second token."""
    r, fake = router()
    fake.prefills["p0"] = PrefillScript(first_token_at_accept=True)
    reply = complete(r, max_tokens=max_tokens)
    [pull] = fake.calls_to("generate", "d0")
    assert (pull.first_token, pull.first_text, pull.kv_tokens) == (token_at(0), f" w{token_at(0)}", 20)
    assert pull.token_ids == [5] * 20 and pull.max_tokens == max_tokens  # decode extends the prompt itself
    assert tokens_of(reply["choices"][0]["text"]) == [token_at(s) for s in range(max_tokens)]
    meta = reply["prfaas"]
    assert meta["route"] == "remote" and meta["stages"]["decode_ms"] == 0.0 and not meta["fallback"]
    assert reply["usage"]["completion_tokens"] == max_tokens and fake.blobs == {} and fake.released == []


def test_direct_mode_pulls_from_the_prefill_instance() -> None:
    r, fake = router("direct")
    assert complete(r)["prfaas"]["route"] == "remote"
    [body], [pull] = fake.calls_to("prefill"), fake.calls_to("generate")
    assert body.push_to == "" and pull.kv_address == "p0:1"


def test_an_unreachable_prefill_falls_back_and_its_breaker_opens() -> None:
    r, fake = router()
    fake.prefills["p0"] = PrefillScript(unreachable=True)
    for _ in range(3):
        meta = complete(r)["prfaas"]
        assert (meta["route"], meta["fallback"], meta["retries"]) == ("local", True, 1), meta
        assert "KV_UNAVAILABLE" in meta["reason"]
    assert r.scheduler.breakers.state("p0") == "open"
    meta = complete(r)["prfaas"]  # the breaker keeps the next request off it: no failed attempt first
    assert (meta["route"], meta["reason_code"], meta["fallback"]) == ("local", "no_prefill", False)
    assert len(fake.calls_to("prefill")) == 3 and fake.blobs == {}


def test_a_prefill_refusal_before_accepted_falls_back() -> None:
    r, fake = router()
    fake.prefills["p0"] = PrefillScript(refuse=KVStoreFull("store over budget"))
    meta = complete(r)["prfaas"]
    assert meta["route"] == "local" and meta["fallback"] and "KV_STORE_FULL" in meta["reason"]
    [local] = [g for g in fake.calls_to("generate") if not g.kv_id]
    assert local.token_ids == [5] * 20 and fake.blobs == {}


def test_a_prefill_that_fails_after_accepting_falls_back_and_leaves_no_blob() -> None:
    r, fake = router()
    fake.prefills["p0"] = PrefillScript(fail_after_accept=KVUnavailable("engine died"))
    reply = complete(r)
    meta = reply["prfaas"]
    assert meta["route"] == "local" and meta["fallback"] and meta["kv_id"]  # the abandoned id stays reported
    assert [bool(g.kv_id) for g in fake.calls_to("generate")] == [True, False]
    assert tokens_of(reply["choices"][0]["text"]) == [token_at(s) for s in range(4)]
    assert fake.blobs == {}


def test_a_prompt_decode_recomputed_is_reported_as_prefilled_locally() -> None:
    r, fake = router()
    fake.decodes["d0"] = DecodeScript(recompute=True)  # its pull failed; vLLM's connector recomputed the prompt
    reply = complete(r)
    meta = reply["prfaas"]
    assert meta["route"] == "local" and meta["fallback"] and "recomputed 19 tokens" in meta["reason"], meta
    assert tokens_of(reply["choices"][0]["text"]) == [token_at(s) for s in range(4)] and fake.blobs == {}


def test_a_prefill_lost_after_its_blob_is_complete_does_not_fail_the_request() -> None:
    r, fake = router()
    fake.prefills["p0"] = PrefillScript(lost_after_blob=True)
    reply = complete(r)
    meta = reply["prfaas"]
    assert meta["route"] == "remote" and not meta["fallback"] and "kv_bytes" not in meta  # its facts were lost
    assert tokens_of(reply["choices"][0]["text"]) == [token_at(s) for s in range(4)]
    assert len(fake.calls_to("generate")) == 1 and fake.blobs == {}


def test_without_fallback_a_failed_prefill_reaches_the_client() -> None:
    r, fake = router(fallback_local_prefill=False)
    fake.prefills["p0"] = PrefillScript(unreachable=True)
    with pytest.raises(KVUnavailable, match="could not be reached"):
        complete(r)
    assert fake.blobs == {}


def test_a_prefill_that_blames_the_request_is_not_retried_and_stays_healthy() -> None:
    r, fake = router()
    fake.prefills["p0"] = PrefillScript(refuse=InvalidRequest("token id out of the vocabulary"))
    for _ in range(4):
        with pytest.raises(InvalidRequest, match="vocabulary"):
            complete(r)
    assert r.scheduler.breakers.state("p0") == "closed"
    assert not [g for g in fake.calls_to("generate") if not g.kv_id]  # no local attempt after a 400


def test_a_degraded_link_keeps_long_prompts_local() -> None:
    r, fake = router()
    for _ in range(50):
        r.scheduler.links.get("dc-a", "dc-b").monitor.record(ok=False)  # the prefills' link to the decodes
    assert complete(r)["prfaas"]["route"] == "remote"  # a probe gets through now and then (link.py)
    meta = complete(r)["prfaas"]
    assert (meta["route"], meta["reason_code"]) == ("local", "link_degraded")
    assert len(fake.calls_to("prefill")) == 1  # the probe's


def test_a_decode_that_dies_mid_stream_is_resumed_elsewhere_without_repeating_tokens() -> None:
    r, fake = router(decodes=2)
    fake.decodes["d0"] = DecodeScript(die_after=2)  # equally loaded: placement takes d0 first (by id)
    reply = complete(r, max_tokens=6)
    meta = reply["prfaas"]
    [first], [resumed] = fake.calls_to("generate", "d0"), fake.calls_to("generate", "d1")
    assert tokens_of(reply["choices"][0]["text"]) == [token_at(s) for s in range(6)]
    assert (meta["route"], meta["decode_instance"], meta["resumed_on"], meta["retries"]) == \
        ("remote", "d0", "d1", 1)
    assert first.kv_id and not resumed.kv_id  # the KV was restored on d0: d1 re-prefills
    assert resumed.step_offset == 2 and resumed.max_tokens == 4
    assert resumed.token_ids == [*first.token_ids, token_at(0), token_at(1)]
    assert fake.blobs == {}


def test_a_decode_that_fails_after_prefills_first_token_is_resumed_elsewhere() -> None:
    """A vLLM decode streams prefill's first token before its own engine runs; that engine failing afterwards
    (an ``error`` event, not a cut connection) is resumed on another instance from the prompt and that token."""
    r, fake = router(decodes=2)
    fake.prefills["p0"] = PrefillScript(first_token_at_accept=True)
    fake.decodes["d0"] = DecodeScript(fail=KVUnavailable("vLLM did not answer"))
    reply = complete(r, max_tokens=4)
    [first], [resumed] = fake.calls_to("generate", "d0"), fake.calls_to("generate", "d1")
    assert tokens_of(reply["choices"][0]["text"]) == [token_at(s) for s in range(4)]
    assert resumed.token_ids == [*first.token_ids, token_at(0)] and not resumed.kv_id
    assert (resumed.step_offset, resumed.max_tokens, resumed.first_token) == (1, 3, -1)
    meta = reply["prfaas"]
    assert (meta["route"], meta["resumed_on"], meta["retries"]) == ("remote", "d1", 1)
    assert reply["usage"]["completion_tokens"] == 4 and fake.blobs == {}


def test_a_decode_error_before_any_token_still_falls_back_on_that_instance() -> None:
    r, fake = router(decodes=2)
    fake.decodes["d0"] = DecodeScript(fail=KVUnavailable("the pull failed"))
    with pytest.raises(KVUnavailable, match="the pull failed"):
        complete(r, SHORT)  # local: nothing streamed, so nothing to resume; the error is the instance's own
    assert not fake.calls_to("generate", "d1")


def test_decode_deaths_open_its_breaker() -> None:
    r, fake = router(decodes=2)
    fake.decodes["d0"] = DecodeScript(die_after=0)
    for _ in range(3):
        assert complete(r, SHORT)["prfaas"]["resumed_on"] == "d1"
    assert r.scheduler.breakers.state("d0") == "open"
    assert "resumed_on" not in complete(r, SHORT)["prfaas"]
    assert r.dispatcher._inflight == {"d0": [0, 0], "d1": [0, 0]}  # each attempt gave back what it reserved


def test_a_finished_request_holds_nothing_once_its_answer_is_returned() -> None:
    r, _ = router()

    async def complete_then_look() -> list[int]:
        await r.complete({"model": r.model_name, "prompt": SHORT, "max_tokens": 2}, chat=False, tenant="default")
        return list(r.dispatcher._inflight["d0"])  # before anything else runs on the loop

    assert run(complete_then_look()) == [0, 0]


def test_a_heartbeat_sent_during_a_request_that_has_ended_since_does_not_count_it() -> None:
    r, fake = router()
    fake.decodes["d0"] = DecodeScript(token_delay_s=0.1)

    async def heartbeat_during_a_request() -> None:
        body = {"model": r.model_name, "prompt": SHORT, "max_tokens": 2}
        request = asyncio.ensure_future(r.complete(body, chat=False, tenant="default"))
        await asyncio.sleep(0.05)
        r.registry.upsert(fake.info("decode", "d0", queue_depth=1))  # it counts that request, running
        await request

    run(heartbeat_during_a_request())
    [seen] = [r.dispatcher._view(i) for i in r.registry.healthy("decode")]
    assert seen.queue_depth == 0
    r.registry.upsert(fake.info("decode", "d0", queue_depth=1))  # sent after it ended: another router's request
    [seen] = [r.dispatcher._view(i) for i in r.registry.healthy("decode")]
    assert seen.queue_depth == 1 and r.dispatcher._ended["d0"] == []


def test_resume_is_bounded_by_the_retry_budget() -> None:
    r, fake = router(decodes=2, kv_retry_budget=0)
    for iid in ("d0", "d1"):
        fake.decodes[iid] = DecodeScript(die_after=1)
    with pytest.raises(KVUnavailable, match="failed"):
        complete(r, SHORT)


def test_a_decode_that_dies_after_its_last_token_ends_the_stream() -> None:
    r, fake = router()
    fake.decodes["d0"] = DecodeScript(die_after=4)
    reply = complete(r, SHORT, max_tokens=4)
    assert reply["choices"][0]["finish_reason"] == "length"
    assert len(fake.calls_to("generate")) == 1 and reply["usage"]["completion_tokens"] == 4


def test_a_stop_sequence_ends_with_stop() -> None:
    r, fake = router()
    fake.decodes["d0"] = DecodeScript(stop_at_step=1)
    reply = complete(r, SHORT, max_tokens=8)
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == 2


def test_requests_queue_for_room_and_are_refused_at_the_deadline() -> None:
    r, fake = router(decode_queue_limit=1, decode_queue_timeout_ms=300)
    fake.decodes["d0"] = DecodeScript(token_delay_s=0.05)

    async def two() -> tuple[Any, Any]:
        first = asyncio.ensure_future(r.complete({"prompt": SHORT, "max_tokens": 4}, chat=False))
        await asyncio.sleep(0.02)  # the first holds the only slot (this router's own count: heartbeats lag)
        second = asyncio.ensure_future(r.complete({"prompt": SHORT, "max_tokens": 4}, chat=False))
        done = await asyncio.gather(first, second, return_exceptions=True)
        return done[0], done[1]

    first, second = run(two())
    assert isinstance(first, dict) and isinstance(second, dict)  # the second waited for the slot, then ran
    fake.decodes["d0"].token_delay_s = 0.2
    first, second = run(two())
    assert isinstance(first, dict)
    assert isinstance(second, KVUnavailable) and "queue deadline" in second.message


def test_a_pool_whose_one_decode_instance_keeps_dying_is_refused_at_once_not_at_the_queue_deadline() -> None:
    r, fake = router(decode_queue_timeout_ms=5000)
    fake.decodes["d0"] = DecodeScript(die_after=0)
    for expected in ("besides d0", "besides d0", "besides d0", "circuit open"):  # 3 failures open its breaker
        started = time.monotonic()
        with pytest.raises(KVUnavailable, match=expected):
            complete(r, SHORT)
        assert time.monotonic() - started < 1.0  # nothing to wait for room on
    assert r.scheduler.breakers.state("d0") == "open" and len(fake.calls_to("generate")) == 3


def test_a_request_no_decode_instance_can_hold_is_refused_at_once() -> None:
    r, fake = router()
    r.registry.upsert(fake.info("decode", "d0", kv_budget_bytes=64 * 10, free_kv_bytes=64 * 10))
    with pytest.raises(KVUnavailable, match="more than any decode instance holds"):
        complete(r)
    assert not fake.calls_to("generate")


def test_tenancy_keeps_kv_in_the_tenants_datacenters() -> None:
    r, fake = router(tenants={"acme": {"allowed_datacenters": ["dc-b"]}, "open": {}})
    meta = complete(r, tenant="acme")["prfaas"]
    assert (meta["route"], meta["reason_code"], meta["tenant"]) == ("local", "tenant_residency", "acme")
    assert complete(r, tenant="open")["prfaas"]["route"] == "remote"
    [body] = fake.calls_to("prefill")
    assert body.tenant == "open"


def test_tenancy_refuses_when_no_decode_is_in_the_tenants_datacenters() -> None:
    r, _ = router(tenants={"acme": {"allowed_datacenters": ["dc-z"]}})
    with pytest.raises(KVUnavailable, match="tenant acme's datacenters"):
        complete(r, tenant="acme")


def test_the_cluster_rate_limit_answers_429() -> None:
    r, _ = router(rate_limit_qps=1)
    complete(r, SHORT)
    with pytest.raises(RateLimited):
        complete(r, SHORT)


def test_a_tokenizer_refusal_reaches_the_client_with_its_param() -> None:
    r, fake = router()
    fake.decodes["d0"] = DecodeScript(refuse_tokenize=InvalidRequest("bad prompt", "prompt"))
    with pytest.raises(InvalidRequest) as info:
        complete(r)
    assert info.value.param == "prompt"


def test_a_stream_ends_with_the_prfaas_field_and_done() -> None:
    r, fake = router()

    async def streamed() -> list[dict[str, Any]]:
        reply = await r.complete({"prompt": LONG, "max_tokens": 3, "stream": True}, chat=False)
        chunks = [part async for part in reply.body_iterator]
        lines = b"".join(c if isinstance(c, bytes) else c.encode() for c in chunks).decode().split("\n\n")
        assert lines[-2] == "data: [DONE]"
        return [json.loads(line[len("data: "):]) for line in lines[:-2]]

    chunks = run(streamed())
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert tokens_of(text) == [token_at(s) for s in range(3)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["prfaas"]["route"] == "remote" and fake.blobs == {}


def test_the_dispatcher_yields_typed_events() -> None:
    r, _fake = router()

    async def events() -> list[Any]:
        job = Job(token_ids=[1, 2, 3], max_tokens=2, sampling=SamplingParams(), stop=[])
        decode = await r.dispatcher.acquire_decode(job)
        return [e async for e in r.dispatcher.run(job, decode)]

    out = run(events())
    assert [type(e) for e in out] == [Token, Token, Done]
    assert out[0].stages is not None and out[1].stages is None




def test_a_chat_is_tokenized_from_its_messages_and_answered_as_a_chat() -> None:
    r, fake = router()
    reply = run(r.complete({"messages": [{"role": "user", "content": LONG}], "max_tokens": 2}, chat=True))
    [asked] = fake.calls_to("tokenize")
    assert asked.messages == [{"role": "user", "content": LONG}] and asked.prompt is None
    assert reply["object"] == "chat.completion" and reply["prfaas"]["route"] == "remote"
    assert tokens_of(reply["choices"][0]["message"]["content"]) == [token_at(0), token_at(1)]
