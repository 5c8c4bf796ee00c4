"""Each role is a class on the shared core passed in: the core installs what every role shares (drain, guards,
health) in the role's app itself, the role adds only its own routes and reports its own load; nothing is patched
onto the core from outside. Real sockets, real store, the synthetic engine; no process is started."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from prfaas.config import load_config
from prfaas.engine import load_engine
from prfaas.services.decode import DecodeService
from prfaas.services.instance import Instance, InstanceOptions
from prfaas.services.prefill import PrefillService
from prfaas.services.roles import DecodeServer, PrefillServer, RelayServer, RoleServer

SHARED = {"/health", "/stats", "/debug/store", "/ready", "/admin/drain", "/metrics"}
MODEL = "synthetic-kimi-linear-48b"


def paths(server: RoleServer) -> set[str]:
    return {getattr(route, "path", "") for route in server.app.routes}


@pytest.fixture
def core_of(tmp_path: Any) -> Iterator[Any]:
    cores: list[Instance] = []

    def make(role: str, with_store: bool) -> Instance:
        config = load_config(None, audit_log=str(tmp_path / "audit-{instance}.jsonl"))
        core = Instance(InstanceOptions(role=role, instance_id=f"{role}-test", router_url="http://127.0.0.1:9"),
                        config, with_store=with_store)
        cores.append(core)
        return core

    yield make
    for core in cores:
        core.close()
        if core.kv is not None:
            assert core.kv.close() == []  # no blob was ever made: none left
        for sock in (core.http_sock, core.kv_sock):
            if sock is not None:
                sock.close()


def test_relay_serves_only_the_shared_routes_and_reports_its_store(core_of: Any) -> None:
    relay = RelayServer(core_of("relay", with_store=True))
    assert paths(relay) >= SHARED
    assert not {"/prefill", "/generate", "/tokenize"} & paths(relay)
    store = relay.core.store
    assert store is not None
    assert relay.core.info().free_kv_bytes == store.budget_bytes and relay.core.info().queue_depth == 0


def test_prefill_and_decode_add_their_routes_on_the_core_they_are_given(core_of: Any) -> None:
    engine = load_engine(MODEL)
    config = load_config(None)
    prefill_core = core_of("prefill", with_store=True)
    prefill = PrefillServer(prefill_core, PrefillService(engine, config.prefill, config.transfer, prefill_core.store))
    decode = DecodeServer(core_of("decode", with_store=False), DecodeService(engine, config))
    try:
        assert SHARED | {"/prefill"} <= paths(prefill) and "/generate" not in paths(prefill)
        assert SHARED | {"/generate", "/tokenize"} <= paths(decode) and "/prefill" not in paths(decode)
        assert decode.core.info().queue_depth == 0  # the role's load, through the core's heartbeat info
        assert not hasattr(decode.core, "load") and not hasattr(decode.core, "app")  # the role owns both
    finally:
        prefill.backend.close()
        decode.backend.close()
