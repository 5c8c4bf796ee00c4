"""How the router reads an instance's non-200 answer (``instance_client.refusal``) and the heartbeat a refusal's body:
only a 400/422 without a code is the request's fault; any other codeless answer is the instance's, and no body,
however odd, stops the heartbeat."""

from __future__ import annotations

import httpx
import pytest

from prfaas.errors import ContextLengthExceeded, InvalidRequest, KVUnauthorized, KVUnavailable, ModelNotFound
from prfaas.services.heartbeat import _message
from prfaas.services.instance_client import refusal

URL = "http://127.0.0.1:1/generate"


def reply(status: int, body: object = None, text: str = "") -> httpx.Response:
    request = httpx.Request("POST", URL)
    if body is None:
        return httpx.Response(status, text=text, request=request)
    return httpx.Response(status, json=body, request=request)


@pytest.mark.parametrize("status", [400, 422])
def test_a_codeless_400_is_the_requests_fault(status: int) -> None:
    exc = refusal(reply(status, {"error": {"message": "bad", "code": None, "param": "temperature"}}))
    assert isinstance(exc, InvalidRequest) and exc.param == "temperature"


@pytest.mark.parametrize("status", [404, 405, 408, 429, 502])
def test_any_other_codeless_answer_is_the_instances(status: int) -> None:
    assert isinstance(refusal(reply(status, {"error": {"message": "no", "code": None}})), KVUnavailable)
    assert isinstance(refusal(reply(status, text="<html>proxy</html>")), KVUnavailable)


def test_a_coded_answer_keeps_its_code() -> None:
    assert isinstance(refusal(reply(403, {"error": {"message": "no", "code": "KV_UNAUTHORIZED"}})), KVUnauthorized)


@pytest.mark.parametrize(("body", "text", "expected"), [
    ({"error": {"message": "wrong role"}}, "", "wrong role"),
    ({"error": "forbidden"}, "", '{"error":"forbidden"}'),
    (["a", "list"], "", '["a","list"]'),
    (None, "plain refusal", "plain refusal"),
])
def test_the_heartbeat_reads_anyrefusal_body(body: object, text: str, expected: str) -> None:
    assert _message(reply(403, body, text)) == expected


@pytest.mark.parametrize(("status", "code"), [(404, "unknown_url"), (405, "METHOD_NOT_ALLOWED"),
                                              (500, "INTERNAL_ERROR"), (502, 502)])
def test_a_code_outside_the_tree_is_read_like_none(status: int, code: object) -> None:
    """Every body now carries a code (``unknown_url``, vLLM's numbers): only a code of prfaas's tree is taken as
    the cause; any other answer is the instance's, as a codeless one."""
    assert isinstance(refusal(reply(status, {"error": {"message": "no", "code": code}})), KVUnavailable)


def test_the_openai_codes_cross_between_roles() -> None:
    assert isinstance(refusal(reply(404, {"error": {"message": "no", "code": "model_not_found"}})), ModelNotFound)
    exc = refusal(reply(400, {"error": {"message": "long", "code": "context_length_exceeded", "param": "prompt"}}))
    assert isinstance(exc, ContextLengthExceeded) and exc.param == "prompt"
