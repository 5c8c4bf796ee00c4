"""Each refusal the issue names — wrong CA, expired certificate, revoked certificate, no certificate, plaintext
client, wrong role — answered with KV_UNAUTHORIZED on the data plane and written to the store's audit log with the
peer identity, while a good certificate still works on the same server."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import Any

import pytest

from prfaas import tls
from prfaas.audit.chain import read_entries
from prfaas.errors import KVUnauthorized
from prfaas.kv import BlobReader
from prfaas.security import certs
from prfaas.services.kvstore import StoreRuntime
from prfaas.transfer import pull, push
from tests.security.conftest import tls_config
from tests.transfer.helpers import assert_same, blob_frames, make_state, run


def client(pki: Path, name: str, ca: Path | None = None, crl: str | None = None) -> ssl.SSLContext:
    return tls.client_context(tls_config(pki, name, ca=ca, crl=crl))


def stranger(pki: Path) -> ssl.SSLContext:
    """A prefill certificate from another CA, that trusts our CA (so only the server can refuse it)."""
    ctx = tls.client_context(tls_config(pki / "stranger", "prefill"))
    ctx.load_verify_locations(cafile=str(pki / "ca.pem"))
    return ctx


def tls_refusals(path: Path) -> list[dict[str, Any]]:
    return [e for _, e, _ in read_entries(path)
            if e and e.get("outcome") == KVUnauthorized.code and e.get("action") == "tls"]


def test_every_handshake_refusal_has_its_code_and_audit_record(pki: Path, as_role: Any, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    certs.issue(pki, "prefill", "prefill-stolen")
    crl = str(certs.revoke(pki, "prefill-stolen"))
    audit = tmp_path / "audit.log"
    config, security = as_role("relay", crl=crl, audit_log=str(audit))
    caplog.set_level(logging.WARNING, "prfaas.security")
    state = make_state(layers=2, tokens=32)
    kv_id, frames = blob_frames(state)
    refused = {"expired": client(pki, "decode-old"), "wrong CA": stranger(pki), "no certificate": _no_cert(pki),
               "revoked": client(pki, "prefill-stolen"), "plaintext": None}

    async def scenario() -> dict[str, str]:
        kv = StoreRuntime(config, "relay-r")
        server = kv.server("127.0.0.1", 0, security)
        address = f"127.0.0.1:{await server.start()}"
        codes: dict[str, str] = {}
        try:
            for what, ctx in refused.items():
                other_id, other_frames = blob_frames(make_state(layers=2, tokens=32, seed=len(codes) + 1))
                try:
                    await push(address, other_id, other_frames, ssl=ctx, timeout_s=5.0)
                    codes[what] = "accepted"
                except KVUnauthorized as exc:
                    codes[what] = exc.code
            await push(address, kv_id, frames, ssl=client(pki, "prefill"), timeout_s=5.0)  # the others still work
            assert_same(state, await pull(address, kv_id, BlobReader(), ssl=client(pki, "decode"), timeout_s=5.0))
            assert kv.store.stats().blobs == 1
        finally:
            await server.close()
            kv.close()
        return codes

    codes = run(scenario)
    assert codes == dict.fromkeys(refused, KVUnauthorized.code)
    records = tls_refusals(audit)
    assert [r["who"] for r in records] == ["127.0.0.1"] * len(refused)
    reasons = [r.getMessage() for r in caplog.records if "refused tls" in r.getMessage()]
    wrong_ca = ("self-signed certificate in certificate chain", "unable to get local issuer certificate")
    for words in ("certificate has expired", wrong_ca, "no client certificate", "certificate revoked", "plaintext"):
        assert any(w in line for line in reasons for w in ((words,) if isinstance(words, str) else words)), words


def _no_cert(pki: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(cafile=str(pki / "ca.pem"))
    return ctx


def test_revoke_command_accumulates_and_keeps_the_first_date(pki: Path) -> None:
    from typer.testing import CliRunner

    from prfaas.cli import app

    def revoke(name: str) -> None:
        result = CliRunner().invoke(app, ["certs", "revoke", str(pki), name])
        assert result.exit_code == 0, result.output

    certs.issue(pki, "decode", "decode-gone")
    revoke("decode-gone")
    first = {r.serial_number: r.revocation_date_utc for r in certs.revoked_list(pki)}
    certs.issue(pki, "relay", "relay-gone")
    revoke("relay-gone")
    revoke("decode-gone")
    after = {r.serial_number: r.revocation_date_utc for r in certs.revoked_list(pki)}
    assert len(after) == len(first) + 1 and all(after[s] == d for s, d in first.items())
    assert CliRunner().invoke(app, ["certs", "revoke", str(pki), "nobody"]).exit_code != 0
