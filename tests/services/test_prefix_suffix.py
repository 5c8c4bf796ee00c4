"""Only the missing KV crosses the WAN, in a whole ``prfaas up`` (direct mode, prefix cache on): a chat's first turn
ships its whole KV and the decode instance's restore stores it in its prefix cache; the next turn's blob holds only
the positions after that prefix, with the monolithic text. A decode instance that lost the prefix since its last
heartbeat refuses the suffix blob (``KV_PREFIX_MISSING``) and the router sends the turn again whole."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from prfaas.engine import load_engine
from tests.conftest import random_prompt
from tests.services.deploy import deployment

KEYS = {tenant: f"{tenant}-key-" + "x" * 24 for tenant in ("acme", "globex")}
MAX_TOKENS = 6
# tiny-llama keeps 512 bytes a token: 1 MiB of prefix cache is 2,048 tokens, so one prompt of 2,100 evicts the rest
EVICTING_TOKENS = 2100
# slow heartbeats: the router goes on believing a prefix is held for seconds after its eviction
HEARTBEAT_MS = 6000


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder: Path = tmp_path_factory.mktemp("suffix")
    path = folder / "prfaas.yaml"
    path.write_text(yaml.safe_dump({
        "prefix_cache_mb": 1, "heartbeat_interval_ms": HEARTBEAT_MS, "heartbeat_timeout_ms": 5 * HEARTBEAT_MS,
        "api_keys": [{"name": f"{t}-key", "key": k, "tenant": t} for t, k in KEYS.items()]}))
    os.chmod(path, 0o600)  # it holds keys
    with deployment("tiny-llama", "direct", threshold=16, extra=("--config", str(path))) as (url, _):
        yield url
        _assert_no_kv_left(url)


def _complete(url: str, tenant: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers=_auth(tenant), timeout=120)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def _monolithic(prompt: list[int]) -> str:
    engine = load_engine("tiny-llama")
    return str(engine.tokenizer.decode(engine.generate(prompt, MAX_TOKENS), skip_special_tokens=True))


def _auth(tenant: str = "acme") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def _decode_entry(url: str) -> dict[str, Any]:
    instances = httpx.get(f"{url}/admin/instances", headers=_auth(), timeout=10).json()
    return dict(next(i for i in instances if i["role"] == "decode"))


def _await_heartbeat_with(url: str, blocks: int) -> None:
    """Until the router's entry of the decode instance names at least ``blocks`` more held blocks than now: just
    after a heartbeat, so the next one is a whole interval away."""
    want = len(_decode_entry(url)["prefix_blocks"]) + blocks
    deadline = time.monotonic() + 3 * HEARTBEAT_MS / 1e3
    while len(_decode_entry(url)["prefix_blocks"]) < want:
        assert time.monotonic() < deadline, "the decode instance never reported the blocks it restored"
        time.sleep(0.02)


def _wan_saved(url: str) -> float:
    instances = httpx.get(f"{url}/admin/instances", headers=_auth(), timeout=10).json()
    address = next(i["url"] for i in instances if i["role"] == "prefill")
    text = httpx.get(f"{address}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "prfaas_prefix_wan_bytes_saved_total")


def _assert_no_kv_left(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stores = httpx.get(f"{url}/admin/kv", headers=_auth(), timeout=10).json()
        if all(report["store"]["blobs"] == 0 for report in stores.values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"KV left in the stores: {stores}")


def test_the_next_turn_ships_only_the_new_tokens_kv(deployed: str) -> None:
    first = random_prompt(150, seed=41)
    one = _complete(deployed, "acme", first)
    assert one["prfaas"]["route"] == "remote" and "kv_prefix_tokens" not in one["prfaas"], one["prfaas"]
    _await_heartbeat_with(deployed, 150 // 16)  # the restore stored turn 1's full blocks on the decode instance
    saved = _wan_saved(deployed)
    turn = first + random_prompt(40, seed=42)
    two = _complete(deployed, "acme", turn)
    meta = two["prfaas"]
    assert meta["route"] == "remote" and meta["kv_prefix_tokens"] == 144 and meta["retries"] == 0, meta
    print(f"KV bytes: turn 1 ({len(first)} tokens) {one['prfaas']['kv_bytes']}, turn 2 ({len(turn)} tokens, "
          f"{len(turn) - 144} shipped) {meta['kv_bytes']}")
    assert meta["kv_bytes"] < one["prfaas"]["kv_bytes"]
    assert _wan_saved(deployed) - saved == 144 * 512  # every attention position of the prefix, before the codec
    assert two["choices"][0]["text"] == _monolithic(turn)


def test_a_suffix_blob_whose_prefix_was_evicted_is_sent_again_whole(deployed: str) -> None:
    first = random_prompt(150, seed=43)
    _complete(deployed, "acme", first)
    _await_heartbeat_with(deployed, 150 // 16)
    _complete(deployed, "globex", random_prompt(EVICTING_TOKENS, seed=44))  # its restore evicts acme's blocks,
    # and the router learns of it only at the next heartbeat
    turn = first + random_prompt(40, seed=45)
    two = _complete(deployed, "acme", turn)
    meta = two["prfaas"]
    assert meta["route"] == "remote" and meta["retries"] == 1 and "kv_prefix_tokens" not in meta, meta
    assert meta["kv_bytes"] > len(turn) * 512  # the whole prompt's KV
    assert two["choices"][0]["text"] == _monolithic(turn)
