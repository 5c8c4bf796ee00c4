from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from prfaas.errors import InvalidRequest, KVUnauthorized
from prfaas.security import certs, policy
from prfaas.security.identity import peer_from_cert


def test_init_makes_a_ca_and_one_certificate_per_role_with_private_keys(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "prfaas", "certs", "init", str(tmp_path / "pki")],
                         capture_output=True, text=True, check=True).stdout
    assert "router:" in out and "ca:" in out
    for role in certs.ROLES:
        cert = x509.load_pem_x509_certificate((tmp_path / "pki" / f"{role}.pem").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert f"spiffe://prfaas/{role}/{role}" in san.get_values_for_type(x509.UniformResourceIdentifier)
    for key in (tmp_path / "pki").glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    with pytest.raises(InvalidRequest):
        certs.init(tmp_path / "pki")  # never overwrite a CA


def test_issue_adds_an_instance_with_extra_hosts(tmp_path: Path) -> None:
    certs.init(tmp_path)
    subprocess.run([sys.executable, "-m", "prfaas", "certs", "issue", "--role", "prefill", "--name", "prefill-7",
                    "--dir", str(tmp_path), "--host", "10.1.2.3", "--host", "pf7.dc-a"], check=True,
                   capture_output=True)
    cert = x509.load_pem_x509_certificate((tmp_path / "prefill-7.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "pf7.dc-a" in san.get_values_for_type(x509.DNSName)
    assert stat.S_IMODE((tmp_path / "prefill-7.key").stat().st_mode) == 0o600
    with pytest.raises(InvalidRequest):
        certs.issue(tmp_path, "admin", "x")


def test_identity_and_policy() -> None:
    cert = {"subject": ((("commonName", "decode-3"),),),
            "subjectAltName": (("DNS", "localhost"), ("URI", "spiffe://prfaas/decode/decode-3"))}
    peer = peer_from_cert(cert, "10.0.0.9")
    assert (peer.role, peer.name, peer.identity) == ("decode", "decode-3", "decode/decode-3@10.0.0.9")
    assert peer_from_cert({"subject": ((("commonName", "x"),),)}).role is None
    assert peer_from_cert(None, "1.2.3.4").identity == "1.2.3.4"
    policy.authorize("prefill", "kv.write")
    policy.authorize("router", "kv.release")
    for role, op in (("decode", "kv.write"), ("prefill", "kv.read"), ("decode", "assign"), ("router", "register"),
                     (None, "kv.stat"), ("prefill", "no.such.operation")):
        with pytest.raises(KVUnauthorized):
            policy.authorize(role, op)
