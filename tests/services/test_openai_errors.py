"""The official ``openai`` client against a real ``prfaas up``: each error raises the class a user of OpenAI or vLLM
expects, with ``code`` always set (OpenAI's own where it names the condition, else prfaas's wire code), and
``/v1/models`` names the directory the served model's tokenizer loads from (``root``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.services.deploy import deployment

MODEL = "tiny-llama"  # SmolLM2's tokenizer, random weights: fast to load
KEY, SLOW_KEY = "sk-user-" + "0" * 24, "sk-slow-" + "1" * 24
AUTH = {"Authorization": f"Bearer {KEY}"}
TOO_LONG = [1] * 8000  # with max_tokens=1000, over the model's 8,192-token context


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, openai.OpenAI]]:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(yaml.safe_dump({"api_keys": [{"name": "user", "key": KEY},
                                                 {"name": "slow", "key": SLOW_KEY, "rate_limit_qps": 0.01}]}))
    path.chmod(0o600)
    with deployment(MODEL, "direct", extra=("--config", str(path))) as (url, _):
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        stores = httpx.get(f"{url}/admin/kv", headers=AUTH).json()
        assert stores and all(report["store"]["blobs"] == 0 for report in stores.values()), stores


def _stream_unknown(client: openai.OpenAI) -> Any:
    return client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, stream=True)


# (what, the call, the class, HTTP status, code, param)
CASES: list[tuple[str, Callable[[openai.OpenAI], Any], type[openai.APIStatusError], int, str, str | None]] = [
    ("unknown model", lambda c: c.completions.create(model="no-such-model", prompt="hi", max_tokens=2),
     openai.NotFoundError, 404, "model_not_found", "model"),
    ("unknown model, streamed chat", _stream_unknown, openai.NotFoundError, 404, "model_not_found", "model"),
    ("retrieve an unknown model", lambda c: c.models.retrieve("no-such-model"),
     openai.NotFoundError, 404, "model_not_found", "model"),
    ("temperature out of range", lambda c: c.completions.create(model=MODEL, prompt="hi", temperature=5),
     openai.BadRequestError, 400, "INVALID_REQUEST", "temperature"),
    ("a field prfaas does not serve", lambda c: c.completions.create(model=MODEL, prompt="hi", logprobs=2),
     openai.BadRequestError, 400, "INVALID_REQUEST", "logprobs"),
    ("n above 1", lambda c: c.completions.create(model=MODEL, prompt="hi", n=2),
     openai.BadRequestError, 400, "INVALID_REQUEST", "n"),
    ("over the context", lambda c: c.completions.create(model=MODEL, prompt=TOO_LONG, max_tokens=1000),
     openai.BadRequestError, 400, "context_length_exceeded", "prompt"),
    ("unknown URL", lambda c: c.get("/no-such-route", cast_to=object),
     openai.NotFoundError, 404, "unknown_url", None),
]


@pytest.mark.parametrize(("call", "cls", "status", "code", "param"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_each_error_raises_the_class_a_user_expects(served: tuple[str, openai.OpenAI], call: Any, cls: type,
                                                    status: int, code: str, param: str | None) -> None:
    _, client = served
    with pytest.raises(openai.APIStatusError) as raised:
        call(client)
    error = raised.value
    assert type(error) is cls and error.status_code == status, error
    assert error.code == code and error.param == param and error.type == "invalid_request_error", error.body


def test_keys_refused_and_rate_limited_as_openai_does(served: tuple[str, openai.OpenAI]) -> None:
    url, _ = served
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong-" + "2" * 24, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    slow = openai.OpenAI(base_url=f"{url}/v1", api_key=SLOW_KEY, max_retries=0)
    slow.models.list()  # the key's one request of its burst
    with pytest.raises(openai.RateLimitError) as limited:
        slow.models.list()
    assert limited.value.code == "RATE_LIMITED" and limited.value.response.headers["retry-after"]


def test_no_error_body_has_a_null_code(served: tuple[str, openai.OpenAI]) -> None:
    url, _ = served
    replies = [httpx.post(f"{url}/v1/completions", content=b"{not json", headers=AUTH),
               httpx.post(f"{url}/v1/completions", json=[1, 2], headers=AUTH),
               httpx.delete(f"{url}/v1/completions", headers=AUTH),
               httpx.get(f"{url}/nowhere", headers=AUTH)]
    for reply in replies:
        assert reply.status_code >= 400 and isinstance(reply.json()["error"]["code"], str), reply.text
    assert [r.json()["error"]["code"] for r in replies[2:]] == ["METHOD_NOT_ALLOWED", "unknown_url"]


def test_models_name_the_tokenizer_directory(served: tuple[str, openai.OpenAI]) -> None:
    """``root`` is a directory a load tool can load the tokenizer from, and a request may name the model by it."""
    _, client = served
    (card,) = client.models.list().data
    root = Path(card.model_extra["root"])
    assert card.id == MODEL and (root / "tokenizer.json").is_file() and card.model_extra["max_model_len"] == 8192
    assert client.models.retrieve(str(root)).id == MODEL
    out = client.completions.create(model=str(root), prompt="The capital of France is", max_tokens=2, temperature=0)
    assert out.model == MODEL and out.usage is not None and out.usage.completion_tokens == 2
