"""The stream events' codec (``prfaas.events``) and the strict decoding of the messages between roles."""

from __future__ import annotations

import json
from typing import Any

import pytest

from prfaas.errors import InvalidRequest, KVBadFormat, KVStoreFull, PrfaasError
from prfaas.events import (
    Accepted,
    Done,
    Failed,
    PrefillDone,
    Stages,
    Token,
    generate_event,
    prefill_event,
)
from prfaas.messages import WIRE_VERSION, GenerateRequest, InstanceInfo, PrefillRequest, ResponseMeta, SamplingParams

DONE = PrefillDone(first_token=7, kv_bytes=1024, chunks=2, prefill_ms=3.5, queue_ms=0.25)


@pytest.mark.parametrize("event", [Accepted(), DONE, Failed(code="KV_STORE_FULL", message="full")])
def test_prefill_events_round_trip(event: Any) -> None:
    assert prefill_event(event.encode()) == event


@pytest.mark.parametrize("event", [
    Token(token=3, text="a", stages=Stages(transfer_ms=1.5, restore_ms=0.5)), Token(token=4),
    Done(finish_reason="stop", completion_tokens=2, text="!"), Failed(code="KV_NOT_FOUND", message="gone"),
])
def test_generate_events_round_trip(event: Any) -> None:
    assert generate_event(event.encode()) == event


def test_the_wire_form_is_the_ndjson_the_roles_always_spoke() -> None:
    assert json.loads(Token(token=3, text="a", stages=Stages(transfer_ms=1.5)).encode()) == {
        "event": "token", "token": 3, "text": "a", "stages": {"transfer_ms": 1.5}}
    assert json.loads(Token(token=3).encode()) == {"event": "token", "token": 3, "text": ""}
    assert Failed.of(KVStoreFull("over budget")).encode() == b'{"event": "error", "code": "KV_STORE_FULL", ' \
                                                              b'"message": "over budget"}\n'


@pytest.mark.parametrize(("line", "match"), [
    (b"not json", "not JSON"), (b"[1]", "unexpected stream event"), (b'{"event": "token"}', "lacks"),
    (b'{"event": "token", "token": "3"}', "integer"), (b'{"event": "token", "token": true}', "integer"),
    (b'{"event": "token", "token": 3, "colour": "red"}', "does not know"),
    (b'{"event": "token", "token": 3, "stages": {"warp_ms": 1}}', "does not know"),
    (b'{"event": "token", "token": 3, "stages": {"transfer_ms": NaN}}', "finite"),
    (b'{"event": "accepted"}', "unexpected stream event"),  # a prefill's event on decode's stream
    (b'{"event": "done", "finish_reason": "tired", "completion_tokens": 1}', "finish_reason"),
])
def test_generate_stream_decoding_is_strict(line: bytes, match: str) -> None:
    with pytest.raises(KVBadFormat, match=match):
        generate_event(line)


def test_prefill_stream_decoding_is_strict() -> None:
    with pytest.raises(KVBadFormat, match="does not know"):  # decode's done on a prefill stream
        prefill_event(b'{"event": "done", "finish_reason": "stop", "completion_tokens": 1}')
    with pytest.raises(KVBadFormat, match="lacks"):
        prefill_event(b'{"event": "done", "first_token": 1}')
    with pytest.raises(KVBadFormat, match="unexpected"):
        prefill_event(b'{"event": "token", "token": 1}')


def test_a_failed_event_rebuilds_its_error() -> None:
    assert isinstance(Failed(code="KV_STORE_FULL", message="x").error(), KVStoreFull)
    unknown = Failed(code="SOMETHING_NEW", message="x").error()
    assert type(unknown) is PrfaasError and "SOMETHING_NEW" in unknown.message


def test_sampling_travels_typed_and_is_checked_on_arrival() -> None:
    body = GenerateRequest(request_id="r", token_ids=[1], max_tokens=2, sampling=SamplingParams(0.5, 0.9, 7))
    wire = body.to_json()
    assert wire["sampling"] == {"temperature": 0.5, "top_p": 0.9, "seed": 7} and wire["wire"] == WIRE_VERSION
    again = GenerateRequest.from_json(wire)
    assert again == body and isinstance(again.sampling, SamplingParams)
    with pytest.raises(InvalidRequest) as info:
        GenerateRequest.from_json({**wire, "sampling": [0.5]})
    assert info.value.param == "sampling"
    with pytest.raises(InvalidRequest) as info:
        PrefillRequest.from_json({"request_id": "r", "kv_id": "k", "token_ids": [1],
                                  "sampling": {"temperature": 0.5, "top_k": 3}})
    assert info.value.param == "top_k"


@pytest.mark.parametrize(("kind", "base"), [
    (GenerateRequest, {"request_id": "r", "token_ids": [1], "max_tokens": 1}),
    (PrefillRequest, {"request_id": "r", "kv_id": "k", "token_ids": [1]}),
    (InstanceInfo, {"instance_id": "i", "role": "decode", "url": "http://x"}),
])
def test_unknown_fields_are_refused_by_name(kind: Any, base: dict[str, Any]) -> None:
    kind.from_json(base)
    with pytest.raises(InvalidRequest, match="does not know") as info:
        kind.from_json({**base, "max_tokenz": 1})
    assert info.value.param == "max_tokenz"
    with pytest.raises(InvalidRequest, match="does not know"):  # a peer at this version made a mistake
        kind.from_json({**base, "max_tokenz": 1, "wire": WIRE_VERSION})
    newer = kind.from_json({**base, "max_tokenz": 1, "wire": WIRE_VERSION + 1})  # a newer peer's addition
    assert newer == kind.from_json(base) and newer.to_json()["wire"] == WIRE_VERSION


def test_a_newer_peers_sampling_fields_are_dropped_with_its_message() -> None:
    body = {"request_id": "r", "token_ids": [1], "max_tokens": 1, "sampling": {"seed": 3, "top_k": 5}}
    with pytest.raises(InvalidRequest, match="top_k"):
        GenerateRequest.from_json(body)
    assert GenerateRequest.from_json({**body, "wire": WIRE_VERSION + 1}).sampling == SamplingParams(seed=3)


def test_the_response_field_leaves_out_what_was_never_known() -> None:
    meta = ResponseMeta(tenant="acme", route="local", reason="short", reason_code="below_threshold",
                        decode_instance="d0")
    assert meta.to_json() == {"tenant": "acme", "route": "local", "reason": "short",
                              "reason_code": "below_threshold", "decode_instance": "d0", "retries": 0,
                              "fallback": False}
    meta.add_stages(Stages(transfer_ms=1.234, restore_ms=2.0))
    meta.add_stages(Stages(queue_ms=0.5, transfer_ms=9.0))
    assert meta.to_json()["stages"] == {"queue_ms": 0.5, "transfer_ms": 9.0, "restore_ms": 2.0}
