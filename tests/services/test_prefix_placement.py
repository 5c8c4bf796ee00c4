"""Cache-aware placement in a whole ``prfaas up`` (two decode instances with a prefix cache): a conversation's next
turn goes to the decode instance that served the previous one, because its heartbeat names the blocks it holds,
and that instance's prefix cache hits (its metrics say so)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from prfaas.messages import InstanceInfo
from prfaas.scheduler.placement import PromptPrefix
from tests.conftest import random_prompt
from tests.services.deploy import deployment

KEY = "acme-key-" + "x" * 24
# The second turn computes 44 of 140 tokens where its history is cached, all 140 elsewhere.
FIRST, ADDED = 100, 40
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder: Path = tmp_path_factory.mktemp("placement")
    path = folder / "prfaas.yaml"
    path.write_text(yaml.safe_dump({"prefix_cache_mb": 64,
                                    "api_keys": [{"name": "acme-key", "key": KEY, "tenant": "acme"}]}))
    os.chmod(path, 0o600)  # it holds a key
    # every prompt is local (under the threshold), so each turn's prefill runs on the decode instance chosen
    with deployment("tiny-llama", "direct", threshold=100_000,
                    extra=("--decode", "2", "--config", str(path))) as (url, _):
        _wait_for_decodes(url, 2)
        yield url
        _assert_no_kv_left(url)


def _complete(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=120)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def _instances(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{url}/admin/instances", headers=HEADERS, timeout=10).json())


def _wait_for_decodes(url: str, count: int) -> None:
    """Until ``count`` decode instances are registered (``prfaas up`` is up once the router answers)."""
    deadline = time.monotonic() + 120
    while len([i for i in _instances(url) if i["role"] == "decode" and i["ready"]]) < count:
        assert time.monotonic() < deadline, f"fewer than {count} decode instances registered: {_instances(url)}"
        time.sleep(0.2)


def _saved_tokens(address: str) -> float:
    text = httpx.get(f"{address}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "prfaas_prefix_cache_saved_tokens_total" and s.labels.get("role") == "decode")


def _wait_until_reported(url: str, instance_id: str, prompt: list[int]) -> dict[str, Any]:
    """The instance's registry entry once its heartbeat names every full block of ``prompt`` (a count of held
    blocks would be met by the previous conversation's)."""
    deadline = time.monotonic() + 30
    whole = (len(prompt) - 1) // 16 * 16
    while time.monotonic() < deadline:
        entry = next(i for i in _instances(url) if i["instance_id"] == instance_id)
        info = InstanceInfo(**{f.name: entry[f.name] for f in dataclasses.fields(InstanceInfo)})
        if PromptPrefix(prompt, "acme").held(info) >= whole:
            return entry
        time.sleep(0.1)
    raise AssertionError(f"{instance_id} never reported the {whole} tokens of its prompt as held")


def _assert_no_kv_left(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stores = httpx.get(f"{url}/admin/kv", headers=HEADERS, timeout=10).json()
        if all(report["store"]["blobs"] == 0 for report in stores.values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"KV left in the stores: {stores}")


@pytest.mark.parametrize("seed", [21, 22])
def test_the_next_turn_lands_where_the_conversation_is_cached(deployed: str, seed: int) -> None:
    first_prompt = random_prompt(FIRST, seed=seed)
    first = _complete(deployed, first_prompt)
    served = first["prfaas"]["decode_instance"]
    entry = _wait_until_reported(deployed, served, first_prompt)
    before = _saved_tokens(entry["url"])
    # the next turn re-sends the history (the answer's text stands in for its tokens) and adds the user's turn
    second = _complete(deployed, first_prompt + random_prompt(ADDED, seed=seed + 100))
    assert second["prfaas"]["route"] == "local", second["prfaas"]
    assert second["prfaas"]["decode_instance"] == served, (first["prfaas"], second["prfaas"])
    assert _saved_tokens(entry["url"]) - before == (FIRST - 1) // 16 * 16  # every full block of the first prompt
