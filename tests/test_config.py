"""The config: one flat YAML file sorted into frozen per-concern sections under one frozen root; bad input refused
the same way as before the sections (``InvalidRequest`` naming the key); docs/configuration.md names each key's
section."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from prfaas.config import (
    SECTION_OF,
    SECTIONS,
    WHOLE,
    Config,
    DecodeConfig,
    PrefillConfig,
    RouterConfig,
    SLOConfig,
    StoreConfig,
    TransferConfig,
    from_dict,
    load_config,
)
from prfaas.errors import InvalidRequest
from prfaas.limits import WireLimits
from prfaas.tls import TLSConfig

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

# a value other than the default for every flat key of a section
CHANGED = {
    "kv_transfer_timeout_ms": 900, "kv_retry_budget": 5, "max_inflight_kv": 4, "chunk_size_kb": 256,
    "serialization": "msgpack", "checksum": "xxhash64", "encryption": "none", "transfer_streams": 3,
    "kv_codec": "fp8", "kv_ttl_seconds": 200.0, "eviction_policy": "ttl", "store_budget_mb": 64,
    "store_backend": "redis", "redis_url": "unix:///tmp/r.sock", "redis_maxmemory_policy": "", "redis_ca": "ca.pem",
    "audit_log": "a-{instance}.jsonl", "store_key_file": "k.key", "rate_limit_qps": 5.0, "degrade_p99_ms": 70.0,
    "success_rate_threshold": 0.5, "offload_threshold_tokens": 9, "fallback_local_prefill": False,
    "decode_queue_limit": 3, "decode_queue_timeout_ms": 7, "pools": {"m": 2.0}, "pool_weights_file": "w.json",
    "slo": {"ttft_p99_ms": 1.0}, "prefill_chunk_tokens": 64, "prefill_max_batch": 2, "prefill_batch_tokens": 99,
    "prefix_cache_mb": 8,
    "prefix_cache_ttl_s": 30.0,
    "decode_max_batch": 4, "datacenter": "dc-b", "api_keys": ["k" * 32], "heartbeat_interval_ms": 100,
    "heartbeat_timeout_ms": 900, "drain_timeout_ms": 5,
    "offload_policy": "cost", "link_share": 0.5, "link_bandwidth_bps": 1e10, "prefill_profile": "p.json",
    "local_profile": "l.json", "adaptive_codec": {"min_agreement": 0.99}, "cluster": "east",
    "local_tokenizer": False,
}


def test_every_flat_key_lands_in_its_frozen_section(tmp_path: Path) -> None:
    assert set(CHANGED) == set(SECTION_OF)  # the table above covers every section key
    path = tmp_path / "prfaas.yaml"
    path.write_text(yaml.safe_dump(CHANGED))
    config = load_config(path)
    assert config.transfer == TransferConfig(900, 5, 4, 256, "msgpack", "xxhash64", "none", 3, "fp8")
    assert config.prefill == PrefillConfig(64, 2, 99, 8, 30.0) and config.decode == DecodeConfig(4)
    assert config.router.slo == SLOConfig(ttft_p99_ms=1.0) and config.router.pools == {"m": 2.0}
    assert config.store.store_budget_bytes == 64 * 1024 * 1024 and config.transfer.chunk_bytes == 256 * 1024
    assert config.common.api_keys == ("k" * 32,)
    for key, section in SECTION_OF.items():
        value = getattr(getattr(config, section), key)
        assert getattr(config, key) == value  # the flat read-only alias reads the section
        assert value != getattr(SECTIONS[section](), key) or key in ("serialization", "checksum"), key
    for part in [config, *(getattr(config, name) for name in SECTIONS)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            part.datacenter = "elsewhere"
    assert from_dict(config.to_dict()) == config  # the flat keys round-trip


def test_flat_keys_on_the_root_are_read_only() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().kv_codec = "fp8"


@pytest.mark.parametrize(("data", "message"), [
    ({"kv_ttl": 100}, r"unknown keys \['kv_ttl'\]"),
    ({"kv_ttl_seconds": "long"}, "kv_ttl_seconds must be a number, not str"),  # a wrong type
    ({"chunk_size_kb": [1]}, "chunk_size_kb must be an integer, not list"),
    ({"decode_max_batch": 8.5}, "decode_max_batch must be an integer, not float"),
    ({"fallback_local_prefill": "yes"}, "fallback_local_prefill must be true or false, not str"),
    ({"rate_limit_qps": True}, "rate_limit_qps must be a number, not bool"),
    ({"api_keys": "secret"}, "api_keys must be a list of keys"),
    ({"pools": ["a"]}, "pools must be a mapping"),
    ({"pools": {"a": "x"}}, "pools must be a mapping of model name or pool key to a weight"),
    ({"tls": {"certificate": "x"}}, "unexpected keyword argument 'certificate'"),
    ({"slo": {"ttft": 1}}, "unexpected keyword argument 'ttft'"),
    ({"tenants": ["a"]}, "tenants must be a mapping"),
    ({"kv_ttl_seconds": 30}, "kv_ttl_seconds must be within 60–300"),
    ({"heartbeat_interval_ms": 5000}, "heartbeat_timeout_ms must exceed"),
    ({"decode_max_batch": 0}, "decode_max_batch must be within"),
    ({"prefix_cache_mb": -1}, "prefix_cache_mb must be ≥ 0"),
    ({"prefix_cache_ttl_s": 0}, "prefix_cache_ttl_s must be within 1–86400"),
    ({"chunk_size_kb": 1024, "limits": {"max_chunk_bytes": 65536}}, "must not exceed limits.max_chunk_bytes"),
])
def test_bad_input_is_refused_naming_the_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        from_dict(data)


def test_replace_routes_flat_keys_to_their_sections() -> None:
    config = Config().replace(offload_threshold_tokens=0, datacenter="dc-a", kv_codec=None,
                              limits=WireLimits(max_layers=3), tls=TLSConfig(required=False))
    assert config.router.offload_threshold_tokens == 0 and config.common.datacenter == "dc-a"
    assert config.transfer == TransferConfig() and config.limits.max_layers == 3  # None keeps the file's value
    with pytest.raises(InvalidRequest, match="unknown keys"):
        Config().replace(offload=1)
    with pytest.raises(InvalidRequest, match="offload_threshold_tokens must be ≥ 0"):
        Config().replace(offload_threshold_tokens=-1)


def test_roles_take_their_sections() -> None:
    from prfaas.scheduler import Scheduler

    scheduler = Scheduler(RouterConfig(offload_threshold_tokens=7), "relay")
    assert scheduler.config.offload_threshold_tokens == 7 and not hasattr(scheduler.config, "kv_ttl_seconds")
    assert StoreConfig().store_budget_bytes == 4096 * 1024 * 1024


def test_the_docs_name_every_key_and_its_section() -> None:
    text = DOCS.read_text()
    for name, cls in SECTIONS.items():
        line = next((ln for ln in text.splitlines() if f"`{cls.__name__}`" in ln and f"`{name}`" in ln), None)
        assert line is not None, f"docs/configuration.md does not name section {name} ({cls.__name__})"
    for key in [*SECTION_OF, *WHOLE]:
        assert re.search(rf"`{key}[`:]", text), f"docs/configuration.md does not mention {key}"
