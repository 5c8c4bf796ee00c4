"""``prfaas certs revoke`` takes effect without a restart: contexts that check ``tls.crl`` load a changed list
(``tls.reload_crls``, run by ``tls.watch_crls``), and the next real TLS 1.3 handshake — server checking a client,
or client checking a server — refuses the revoked certificate while the others still pass. A list that cannot
be parsed leaves the loaded one in force."""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest
from cryptography import x509

from prfaas import tls
from prfaas.config import Config, TLSConfig
from prfaas.security import certs
from prfaas.security.runtime import Security


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    """A CA of its own (the revocations here must not reach other tests), a spare certificate per side, and a
    revocation list that names neither yet."""
    root = tmp_path / "pki"
    certs.init(root)
    for role, name in (("prefill", "prefill-2"), ("relay", "relay-2"), ("decode", "retired")):
        certs.issue(root, role, name)
    certs.revoke(root, "retired")
    return root


def context(pki: Path, name: str, server: bool, crl: bool) -> ssl.SSLContext:
    config = TLSConfig(ca=str(pki / "ca.pem"), cert=str(pki / f"{name}.pem"), key=str(pki / f"{name}.key"),
                       required=True, crl=str(pki / "crl.pem") if crl else None)
    return tls.server_context(config) if server else tls.client_context(config)


def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> str:
    """One TLS 1.3 handshake over a socket pair and one byte echoed: "ok", or why the refusing side refused (its
    certificate check's message; the other side only hears an alert)."""
    a, b = socket.socketpair()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            with server_ctx.wrap_socket(a, server_side=True) as conn:
                conn.sendall(conn.recv(1))
        except (ssl.SSLError, OSError) as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    echoed = b""
    try:
        with client_ctx.wrap_socket(b, server_hostname="localhost") as conn:
            conn.sendall(b"x")
            echoed = conn.recv(1)
    except (ssl.SSLError, OSError) as exc:
        errors.append(exc)
    finally:
        thread.join(10)
        a.close()
        b.close()
    if echoed == b"x" and not errors:
        return "ok"
    checks = [e.verify_message for e in errors if isinstance(e, ssl.SSLCertVerificationError)]
    return checks[0] if checks else "; ".join(map(str, errors))


def test_a_server_refuses_a_client_revoked_after_it_started(pki: Path) -> None:
    server = context(pki, "relay", server=True, crl=True)
    assert handshake(server, context(pki, "prefill-2", server=False, crl=False)) == "ok"
    certs.revoke(pki, "prefill-2")
    assert handshake(server, context(pki, "prefill-2", server=False, crl=False)) == "ok"  # not re-read yet
    assert tls.reload_crls() == [str(pki / "crl.pem")]
    assert handshake(server, context(pki, "prefill-2", server=False, crl=False)) == "certificate revoked"
    assert handshake(server, context(pki, "prefill", server=False, crl=False)) == "ok"
    assert tls.reload_crls() == []  # unchanged since: nothing loaded again


def test_a_client_refuses_a_server_revoked_after_it_started(pki: Path) -> None:
    client = context(pki, "decode", server=False, crl=True)
    certs.revoke(pki, "relay-2")
    tls.reload_crls()
    assert handshake(context(pki, "relay-2", server=True, crl=False), client) == "certificate revoked"
    assert handshake(context(pki, "relay", server=True, crl=False), client) == "ok"


def test_the_watcher_applies_a_revocation_without_being_asked(pki: Path) -> None:
    server = context(pki, "relay", server=True, crl=True)
    tls.watch_crls(0.05)  # a watcher started earlier in this process may check only every CRL_CHECK_S
    certs.revoke(pki, "prefill-2")
    deadline = time.monotonic() + 3 * tls.CRL_CHECK_S
    while handshake(server, context(pki, "prefill-2", server=False, crl=False)) == "ok":
        assert time.monotonic() < deadline, "the watcher never loaded the new list"
        time.sleep(0.05)
    assert handshake(server, context(pki, "prefill", server=False, crl=False)) == "ok"


def test_a_configured_process_watches_its_list(pki: Path) -> None:
    """``Security.of`` (what every role calls at start) starts the watcher: the server context a role hands
    its listeners refuses a certificate revoked after start-up, within a few checks."""
    tls_config = TLSConfig(ca=str(pki / "ca.pem"), cert=str(pki / "relay.pem"), key=str(pki / "relay.key"),
                           required=True, crl=str(pki / "crl.pem"))
    server = Security.of(Config(tls=tls_config), "relay").server_ssl()
    assert server is not None
    certs.revoke(pki, "prefill-2")
    deadline = time.monotonic() + 3 * tls.CRL_CHECK_S
    while handshake(server, context(pki, "prefill-2", server=False, crl=False)) == "ok":
        assert time.monotonic() < deadline, "the configured process never loaded the new list"
        time.sleep(0.1)


def test_an_unreadable_list_leaves_the_loaded_one_in_force(pki: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = context(pki, "relay", server=True, crl=True)
    crl = pki / "crl.pem"
    good = crl.read_bytes()
    crl.write_bytes(good[: len(good) // 2])  # a copy cut short
    caplog.set_level(logging.WARNING, "prfaas.security")
    assert tls.reload_crls() == []
    assert any("cannot reload the revocation list" in r.getMessage() for r in caplog.records)
    assert handshake(server, context(pki, "retired", server=False, crl=False)) == "certificate revoked"
    assert handshake(server, context(pki, "prefill", server=False, crl=False)) == "ok"
    crl.write_bytes(good)
    certs.revoke(pki, "prefill-2")
    assert tls.reload_crls() == [str(crl)]  # tried again at the next check
    assert handshake(server, context(pki, "prefill-2", server=False, crl=False)) == "certificate revoked"


def test_each_new_list_is_dated_after_the_last_and_written_whole(pki: Path) -> None:
    dates = []
    for name in ("prefill-2", "relay-2"):  # both within one second
        certs.revoke(pki, name)
        dates.append(x509.load_pem_x509_crl((pki / "crl.pem").read_bytes()).last_update_utc)
    assert dates[1] > dates[0]
    assert sorted(p.name for p in pki.iterdir() if p.name.startswith(".")) == []  # no partial file left
