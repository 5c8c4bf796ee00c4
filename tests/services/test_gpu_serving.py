"""A whole deployment on a GPU, where torch sees one (``prfaas up --device cuda``, bfloat16): every prompt remote
and every prompt local, relay and direct, completions and chat, streamed and not, serve the greedy text of the GPU
engine's own ``generate``; the remote route ships KV and no blob is left. Plain HTTP (httpx): the check needs no
more than the deployment itself."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from prfaas.demo import chat_ids
from prfaas.engine import load_engine
from tests.services.deploy import deployment

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU")
MODEL = "tiny-llama"
MAX_TOKENS = 16
PROMPTS = ["The capital of France is", "Here is a passage. " + "The quick brown fox jumps over the lazy dog. " * 8]


@pytest.fixture(scope="module")
def engine() -> Any:
    return load_engine(MODEL, dtype="bfloat16", device="cuda")


def _text(reply: httpx.Response, stream: bool, chat: bool) -> tuple[str, dict[str, Any]]:
    assert reply.status_code == 200, reply.text
    if not stream:
        body = reply.json()
        choice = body["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]) or "", body["prfaas"]
    text, extension = "", {}
    for line in reply.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        for choice in chunk.get("choices", []):
            text += (choice.get("delta", {}).get("content") if chat else choice.get("text")) or ""
        extension = chunk.get("prfaas", extension)
    return text, extension


@pytest.fixture(scope="module", params=[("relay", 0), ("direct", 0), ("relay", 100_000)],
                ids=["relay-remote", "direct-remote", "local"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    mode, threshold = request.param
    with deployment(MODEL, mode, threshold, ("--device", "cuda", "--dtype", "bfloat16")) as (url, _):
        yield url, "remote" if threshold == 0 else "local"
        stores = httpx.get(f"{url}/admin/kv").json()
        assert all(report["store"]["blobs"] == 0 for report in stores.values()), stores


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_gpu_deployment_serves_the_gpu_engines_tokens(engine: Any, served: tuple[str, str], chat: bool,
                                                         stream: bool) -> None:
    url, route = served
    for prompt in PROMPTS:
        if chat:
            ids = chat_ids(engine, prompt)
            body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
        else:
            ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
            body = {"prompt": prompt}
        expected = engine.tokenizer.decode(engine.generate(ids, MAX_TOKENS), skip_special_tokens=True)
        reply = httpx.post(f"{url}/v1/{'chat/completions' if chat else 'completions'}", timeout=120,
                           json={"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
                                 **body})
        text, extension = _text(reply, stream, chat)
        assert extension["route"] == route, extension
        assert text == expected
        if route == "remote":
            assert extension["kv_bytes"] > 0
