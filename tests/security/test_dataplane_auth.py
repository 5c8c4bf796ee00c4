"""The KV data plane under mutual TLS: each role may do only its part, every refusal is KV_UNAUTHORIZED and lands
in the store's audit log with the peer identity; untrusted, expired and plaintext peers never reach the store."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest

from prfaas import tls
from prfaas.audit.chain import read_entries
from prfaas.errors import KVUnauthorized, PrfaasError
from prfaas.kv import BlobReader
from prfaas.services.kvstore import StoreRuntime
from prfaas.transfer import pull, push, release
from tests.security.conftest import tls_config
from tests.transfer.helpers import assert_same, blob_frames, make_state, run


def client(pki: Path, role: str, ca: Path | None = None) -> ssl.SSLContext:
    return tls.client_context(tls_config(pki, role, ca=ca))


def stranger(pki: Path) -> ssl.SSLContext:
    """A certificate from another CA, that trusts our CA (so only the server can refuse it)."""
    ctx = tls.client_context(tls_config(pki / "stranger", "decode"))
    ctx.load_verify_locations(cafile=str(pki / "ca.pem"))
    return ctx


def refusals(path: Path) -> list[dict[str, Any]]:
    return [e for _, e, _ in read_entries(path) if e and e.get("outcome") == KVUnauthorized.code]


def test_roles_on_the_data_plane(pki: Path, as_role: Any, tmp_path: Path) -> None:
    audit = tmp_path / "audit.log"
    config, security = as_role("relay", audit_log=str(audit))
    state = make_state(layers=2, tokens=32)
    kv_id, frames = blob_frames(state)
    other_id, other_frames = blob_frames(make_state(layers=2, tokens=32, seed=1))

    async def scenario() -> None:
        kv = StoreRuntime(config, "relay-t")
        server = kv.server("127.0.0.1", 0, security)
        address = f"127.0.0.1:{await server.start()}"
        try:
            await push(address, kv_id, frames, ssl=client(pki, "prefill"), timeout_s=5.0)
            with pytest.raises(KVUnauthorized):
                await push(address, other_id, other_frames, ssl=client(pki, "decode"), timeout_s=5.0)
            with pytest.raises(KVUnauthorized):
                await pull(address, kv_id, BlobReader(), ssl=client(pki, "prefill"), timeout_s=5.0, retries=0)
            with pytest.raises(KVUnauthorized):  # the peer does not trust our server
                await pull(address, kv_id, BlobReader(), ssl=client(pki / "stranger", "decode"), timeout_s=5.0,
                           retries=0)
            for ctx in (stranger(pki), client(pki, "decode-old"), None):  # other CA, expired, plaintext
                with pytest.raises(PrfaasError):
                    await push(address, other_id, other_frames, ssl=ctx, timeout_s=5.0)
            assert kv.store.stats().blobs == 1  # only prefill's blob ever reached the store
            assert_same(state, await pull(address, kv_id, BlobReader(), ssl=client(pki, "decode"), timeout_s=5.0))
            await release(address, kv_id, ssl=client(pki, "router"))
        finally:
            await server.close()
            kv.close()

    run(scenario)
    refused = refusals(audit)
    assert [(e["action"], e["who"].split("@")[0]) for e in refused] == [
        ("create", "decode/decode"), ("read", "prefill/prefill"),
        ("tls", "127.0.0.1"),  # the client that did not trust us ended the handshake
        ("tls", "127.0.0.1"), ("tls", "127.0.0.1"), ("tls", "127.0.0.1")]  # other CA, expired, plaintext
    assert refused[0]["kv_id"] == other_id
    assert not any(e and e.get("kv_id") == other_id and e.get("outcome") == "ok" for _, e, _ in read_entries(audit))
