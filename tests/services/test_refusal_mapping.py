"""How the router reads an instance's non-200 answer (``dispatch._refusal``) and the heartbeat a refusal's body:
only a 400/422 without a code is the request's fault; any other codeless answer is the instance's, and no body,
however odd, stops the heartbeat."""

from __future__ import annotations

import httpx
import pytest

from prfaas.errors import InvalidRequest, KVUnauthorized, KVUnavailable
from prfaas.services.dispatch import _refusal
from prfaas.services.heartbeat import _message

URL = "http://127.0.0.1:1/generate"


def reply(status: int, body: object = None, text: str = "") -> httpx.Response:
    request = httpx.Request("POST", URL)
    if body is None:
        return httpx.Response(status, text=text, request=request)
    return httpx.Response(status, json=body, request=request)


@pytest.mark.parametrize("status", [400, 422])
def test_a_codeless_400_is_the_requests_fault(status: int) -> None:
    exc = _refusal(reply(status, {"error": {"message": "bad", "code": None, "param": "temperature"}}))
    assert isinstance(exc, InvalidRequest) and exc.param == "temperature"


@pytest.mark.parametrize("status", [404, 405, 408, 429, 502])
def test_any_other_codeless_answer_is_the_instances(status: int) -> None:
    assert isinstance(_refusal(reply(status, {"error": {"message": "no", "code": None}})), KVUnavailable)
    assert isinstance(_refusal(reply(status, text="<html>proxy</html>")), KVUnavailable)


def test_a_coded_answer_keeps_its_code() -> None:
    assert isinstance(_refusal(reply(403, {"error": {"message": "no", "code": "KV_UNAUTHORIZED"}})), KVUnauthorized)


@pytest.mark.parametrize(("body", "text", "expected"), [
    ({"error": {"message": "wrong role"}}, "", "wrong role"),
    ({"error": "forbidden"}, "", '{"error":"forbidden"}'),
    (["a", "list"], "", '["a","list"]'),
    (None, "plain refusal", "plain refusal"),
])
def test_the_heartbeat_reads_any_refusal_body(body: object, text: str, expected: str) -> None:
    assert _message(reply(403, body, text)) == expected
