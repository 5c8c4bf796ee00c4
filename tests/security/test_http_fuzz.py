"""Property-based fuzzing of the router's control endpoints (``/internal/heartbeat``, ``/internal/deregister``,
``/admin/pools``) in process, through the same ``ErrorBoundary`` ``http.serve`` puts in front of every app: any body
is answered 2xx, or 4xx in the OpenAI error body, never a 5xx. The public and instance endpoints are fuzzed against
a real deployment in ``tests/services/test_http_hardening.py``; these are fuzzed here because a junk registration
would be routed to in a real one."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prfaas.config import Config
from prfaas.services import http
from prfaas.services.router import Router, create_app

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])
TEXT = st.text(max_size=20) | st.sampled_from(["\ud800", "decode", "prefill", "relay", "http://127.0.0.1:1"])
JUNK = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False)
                    | TEXT, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
HEARTBEAT = st.fixed_dictionaries({}, optional={
    "instance_id": TEXT | JUNK, "role": TEXT | JUNK, "url": TEXT | JUNK, "fingerprint": JUNK, "model": TEXT | JUNK,
    "max_seq_len": JUNK, "free_kv_bytes": JUNK, "queue_depth": JUNK, "draining": JUNK, "datacenter": JUNK,
    "tcp_peers": JUNK | st.lists(st.dictionaries(st.sampled_from(["peer", "rtt_ms", "retransmits"]), JUNK),
                                 max_size=3)}) | JUNK
BODIES = {"/internal/heartbeat": HEARTBEAT, "/internal/deregister": st.fixed_dictionaries(
    {}, optional={"instance_id": TEXT | JUNK}) | JUNK, "/admin/pools": st.fixed_dictionaries(
    {}, optional={"weights": st.dictionaries(TEXT, st.floats(-1, 2) | JUNK, max_size=3) | JUNK}) | JUNK}


@pytest.fixture(scope="module")
def app() -> Any:
    return http.ErrorBoundary(create_app(Router(Config())))  # one router for every example: building one is slow


def _answer(app: Any, path: str, body: bytes) -> httpx.Response:
    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                     base_url="http://router") as client:
            return await client.post(path, content=body, headers={"content-type": "application/json"})

    return asyncio.run(scenario())


def _assert_answered(reply: httpx.Response) -> None:
    assert reply.status_code < 500, reply.text[:300]
    if reply.status_code >= 400:
        assert set(reply.json()["error"]) == {"message", "type", "code", "param"}


@FUZZ
@given(st.sampled_from(sorted(BODIES)), st.data())
def test_router_control_endpoints(app: Any, path: str, data: st.DataObject) -> None:
    body: Any = data.draw(BODIES[path])
    _assert_answered(_answer(app, path, json.dumps(body).encode()))


@FUZZ
@given(st.sampled_from(sorted(BODIES)), st.binary(max_size=64))
def test_router_control_endpoints_raw_bytes(app: Any, path: str, body: bytes) -> None:
    _assert_answered(_answer(app, path, body))
