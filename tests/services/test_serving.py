"""End to end: ``prfaas up`` in a subprocess, the official ``openai`` client, tokens compared with a
monolithic ``generate`` of the same model in this process."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from prfaas.demo import chat_ids
from tests.conftest import get_engine
from tests.exactness import near_ties_in_text
from tests.services.deploy import deployment

SHORT = "What is the capital of France?"
LONG = ("Here is a passage. " + "The quick brown fox jumps over the lazy dog near the river bank. " * 12
        + "Summarise the passage in one sentence.")
MAX_TOKENS = 12
CASES = [(m, mode) for m in ("smollm2-135m", "tiny-qwen3-next", "tiny-bamba") for mode in ("relay", "direct")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{mode}" for m, mode in CASES])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, openai.OpenAI, list[str]]]:
    model, mode = request.param
    with deployment(model, mode) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        kv_ids: list[str] = []
        yield url, get_engine(model), client, kv_ids
        _assert_no_kv_left(url, kv_ids)


def _assert_no_kv_left(url: str, kv_ids: list[str]) -> None:
    stores = httpx.get(f"{url}/admin/kv").json()
    assert stores, "no store reported"
    ended = {}
    for report in stores.values():
        assert report["store"]["blobs"] == 0, report["store"]
        ended.update({r["kv_id"]: r["reason"] for r in report["records"]})
    for kv_id in kv_ids:
        assert ended.get(kv_id) in ("released", "expired"), kv_id


def reference(engine: Any, content: str) -> tuple[str, int]:
    ids = chat_ids(engine, content)
    tokens = engine.generate(ids, MAX_TOKENS)
    return engine.tokenizer.decode(tokens, skip_special_tokens=True), len(ids)


def chat(client: openai.OpenAI, model: str, content: str, stream: bool) -> tuple[str, dict[str, Any], Any]:
    messages = [{"role": "user", "content": content}]
    if not stream:
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        return out.choices[0].message.content or "", out.model_extra["prfaas"], out.usage
    text, extension, usage = "", {}, None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
        extension = (chunk.model_extra or {}).get("prfaas", extension)
    return text, extension, usage


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(("content", "route"), [(SHORT, "local"), (LONG, "remote")], ids=["local", "remote"])
def test_tokens_equal_monolithic(served: tuple, content: str, route: str, stream: bool) -> None:
    _, engine, client, kv_ids = served
    expected, prompt_tokens = reference(engine, content)
    text, extension, usage = chat(client, engine.name, content, stream)
    assert extension["route"] == route, extension
    assert text == expected
    assert usage.prompt_tokens == prompt_tokens
    if route == "remote":
        kv_ids.append(extension["kv_id"])
        assert extension["kv_bytes"] > 0 and extension["transfer_ms"] >= 0 and extension["ttft_ms"] > 0
        assert extension["prefill_instance"] == "prefill-0" and extension["decode_instance"] == "decode-0"


def test_eight_concurrent_requests(served: tuple) -> None:
    _, engine, client, kv_ids = served
    prompts = [LONG if i % 2 else SHORT for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: chat(client, engine.name, p, stream=False), prompts))
    for prompt, (text, extension, _) in zip(prompts, results, strict=True):  # batched: near-ties are allowed
        assert text == reference(engine, prompt)[0] or near_ties_in_text(
            engine, chat_ids(engine, prompt), text, MAX_TOKENS) is not None
        if extension["route"] == "remote":
            kv_ids.append(extension["kv_id"])


def test_completions_endpoint_and_models(served: tuple) -> None:
    _, engine, client, _ = served
    assert [m.id for m in client.models.list().data] == [engine.name]
    out = client.completions.create(model=engine.name, prompt="The capital of France is", max_tokens=5,
                                    temperature=0)
    ids = engine.tokenizer.encode("The capital of France is", add_special_tokens=False)
    assert out.choices[0].text == engine.tokenizer.decode(engine.generate(ids, 5), skip_special_tokens=True)


def test_bad_requests_get_openai_errors(served: tuple) -> None:
    url, engine, client, _ = served
    reply = httpx.post(f"{url}/v1/chat/completions", json={"model": engine.name, "messages": "hi"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    reply = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "error" in reply.json()
    with pytest.raises(openai.BadRequestError, match="maximum context length is 8192"):
        client.completions.create(model=engine.name, prompt="hello " * 9000, max_tokens=4)
