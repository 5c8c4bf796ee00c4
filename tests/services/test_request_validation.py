"""A bad request fails alone, fast, as a 400 with the OpenAI error body, and never counts against an instance: on a
real ``prfaas up`` (relay mode, every prompt remote), for the public API and for the internal bodies an instance
accepts (``/prefill``, ``/generate``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from tests.services.deploy import deployment

MODEL = "tiny-llama"
PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # The link's latency verdict is not under test here (what is: a client error never marks it degraded); a
    # loaded CI machine can stretch a chunk's transfer past the default degrade_p99_ms on its own.
    config = tmp_path_factory.mktemp("validation") / "prfaas.yaml"
    config.write_text(yaml.safe_dump({"degrade_p99_ms": 5000}))
    with deployment(MODEL, "relay", threshold=0, extra=("--config", str(config))) as (router_url, _):
        yield router_url


def post(url: str, **fields: Any) -> tuple[httpx.Response, float]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields}
    started = time.monotonic()
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    return reply, time.monotonic() - started


def assert_refused(reply: httpx.Response, param: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and param in error["message"]


def instances(url: str, role: str) -> list[dict[str, Any]]:
    return [i for i in httpx.get(f"{url}/admin/instances").json() if i["role"] == role]


def assert_healthy_and_fast(url: str) -> None:
    for _ in range(3):
        reply, seconds = post(url)
        assert reply.status_code == 200, reply.text
        assert seconds < 1.5, f"an ordinary request took {seconds:.2f} s after the bad ones"
        assert reply.json()["prfaas"]["route"] == "remote"
    assert all(i["breaker"] == "closed" and i["healthy"] for i in instances(url, "decode") + instances(url, "prefill"))
    degraded = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                if line.startswith("prfaas_router_link_degraded ")]
    assert degraded == ["prfaas_router_link_degraded 0.0"]


def test_tiny_temperature_is_a_fast_400_and_harms_no_instance(url: str) -> None:
    for temperature in (1e-40, 1e-300, 1e-5, 5e-324):
        for stream in (False, True):
            reply, seconds = post(url, temperature=temperature, stream=stream)
            assert_refused(reply, "temperature")
            assert seconds < 2.0
    assert_healthy_and_fast(url)


def test_an_instance_refusing_a_request_is_a_400_not_an_instance_failure(url: str) -> None:
    """Token ids outside the vocabulary pass the router (it does not know the vocabulary) and are refused by the
    prefill instance, then would be by decode: the client gets that 400 at once, no instance's breaker opens and
    the link stays healthy (more refusals than a breaker's threshold and the link's minimum sample)."""
    for _ in range(6):
        reply, seconds = post(url, prompt=[*PROMPT, 10**7])
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["type"] == "invalid_request_error" and seconds < 2.0
    assert_healthy_and_fast(url)


@pytest.mark.parametrize(("fields", "param"), [
    ({"logprobs": 2}, "logprobs"), ({"logprobs": True}, "logprobs"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"echo": True}, "echo"), ({"stream": "no"}, "stream"), ({"stream": 0}, "stream"),
    ({"ignore_eos": "false"}, "ignore_eos"), ({"stream": True, "stream_options": {"include_usage": "yes"}},
                                              "stream_options.include_usage"),
    ({"max_tokens": -5}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"), ({"top_p": 0}, "top_p"),
    ({"seed": 1 << 70}, "seed"), ({"temperature": "0.5"}, "temperature"),
])
def test_fields_prfaas_cannot_serve_as_asked_are_refused_by_name(url: str, fields: dict[str, Any],
                                                                 param: str) -> None:
    reply, _ = post(url, **fields)
    assert_refused(reply, param)


def test_fields_that_ask_for_nothing_pass(url: str) -> None:
    reply, _ = post(url, logprobs=None, echo=False, top_logprobs=0, stream=False, ignore_eos=False)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": -5}, "max_tokens"), ({"max_tokens": "8"}, "max_tokens"),
    ({"sampling": {"temperature": 1e-40, "seed": 1}}, "temperature"),
    ({"sampling": {"temperature": 0.7, "top_p": 1.5}}, "top_p"), ({"sampling": {"seed": "1"}}, "seed"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"token_ids": [1, True]}, "token_ids"),
    ({"step_offset": -1}, "step_offset"),
])
def test_decode_refuses_bad_internal_generate_bodies(url: str, body: dict[str, Any], param: str) -> None:
    decode = instances(url, "decode")[0]
    generate = {"request_id": "r", "token_ids": PROMPT, "max_tokens": 4, **body}
    reply = httpx.post(f"{decode['url']}/generate", json=generate, timeout=10)
    assert_refused(reply, param)


def test_prefill_refuses_bad_internal_sampling(url: str) -> None:
    prefill = instances(url, "prefill")[0]
    body = {"request_id": "r", "kv_id": "x", "token_ids": PROMPT, "sampling": {"temperature": 1e-300}}
    reply = httpx.post(f"{prefill['url']}/prefill", json=body, timeout=10)
    assert_refused(reply, "temperature")
    assert_healthy_and_fast(url)
    assert sum(report["store"]["blobs"] for report in httpx.get(f"{url}/admin/kv").json().values()) == 0
