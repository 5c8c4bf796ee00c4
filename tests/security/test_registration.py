"""Registration on a real router process: the role and instance id a heartbeat claims are bound to the certificate
(TLS) or the API key (no TLS) that sends it, and only the owner of a registration may refresh or remove it.

The attack: an instance holding one role's certificate (the relay's) heartbeats as a decode instance with its own
URL and a huge ``free_kv_bytes``; a router that believed it would send it every request's token ids, ``kv_id`` and
KV address. Here the router must refuse it (403 ``KV_UNAUTHORIZED``) and never connect to the fake.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.services.deploy import free_port

CLIENT_KEY = "client-key-0123456789abcdef"
DECODE_KEY = "decode-key-0123456789abcdef"
RELAY_KEY = "relay-key-0123456789abcdef"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and one certificate per role, made by ``prfaas certs init`` as an operator would."""
    root = tmp_path_factory.mktemp("registration-pki")
    subprocess.run([sys.executable, "-m", "prfaas", "certs", "init", str(root)], check=True, capture_output=True)
    return root


def role_tls(pki: Path, role: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(str(pki / f"{role}.pem"), str(pki / f"{role}.key"))
    return ctx


@contextmanager
def router(folder: Path, config: dict[str, Any], verify: Any) -> Iterator[str]:
    """``prfaas serve router`` on a free loopback port with ``config``; yields its URL once it answers."""
    path = folder / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    os.chmod(path, 0o600)
    port = free_port()
    url = f"{'https' if 'tls' in config else 'http'}://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "prfaas", "serve", "router", "--port", str(port), "--config",
                             str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the router exited"
            try:
                httpx.get(f"{url}/health", verify=verify, timeout=1.0)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the router did not start"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextmanager
def listener() -> Iterator[socket.socket]:
    """A port the fake decode claims to serve on; nothing should ever connect to it."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        sock.setblocking(False)
        yield sock


def connected(sock: socket.socket) -> bool:
    try:
        sock.accept()[0].close()
        return True
    except BlockingIOError:
        return False


def beat(url: str, verify: Any, role: str, instance_id: str, fake: str, key: str = "") -> httpx.Response:
    body = {"instance_id": instance_id, "role": role, "url": fake, "kv_address": "127.0.0.1:1",
            "free_kv_bytes": 2**50, "kv_budget_bytes": 2**50, "max_seq_len": 4096}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/internal/heartbeat", json=body, verify=verify, headers=headers, timeout=5.0)


def deregister(url: str, verify: Any, instance_id: str, key: str = "") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/internal/deregister", json={"instance_id": instance_id}, verify=verify,
                      headers=headers, timeout=5.0)


def instances(url: str, verify: Any) -> set[tuple[str, str]]:
    reply = httpx.get(f"{url}/admin/instances", verify=verify, timeout=5.0,
                      headers={"authorization": f"Bearer {CLIENT_KEY}"})
    return {(i["instance_id"], i["role"]) for i in reply.json()}


def refused(reply: httpx.Response) -> bool:
    return reply.status_code == 403 and reply.json()["error"]["code"] == "KV_UNAUTHORIZED"


def test_a_certificate_of_one_role_cannot_register_as_another(pki: Path, tmp_path: Path) -> None:
    tls = {"ca": str(pki / "ca.pem"), "cert": str(pki / "router.pem"), "key": str(pki / "router.key"),
           "required": True}
    public = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    relay, decode = role_tls(pki, "relay"), role_tls(pki, "decode")
    with listener() as fake, router(tmp_path, {"tls": tls, "api_keys": [CLIENT_KEY]}, public) as url:
        fake_url = f"https://127.0.0.1:{fake.getsockname()[1]}"
        assert refused(beat(url, relay, "decode", "relay-0", fake_url))  # the attack: relay's cert as a decode
        assert refused(beat(url, relay, "relay", "decode-0", fake_url))  # its own role, someone else's id
        assert beat(url, relay, "relay", "relay-0", fake_url).status_code == 200  # what it may do
        assert beat(url, decode, "decode", "decode-0", fake_url).status_code == 200
        assert refused(deregister(url, relay, "decode-0"))  # one instance may not remove another
        assert instances(url, public) == {("relay-0", "relay"), ("decode-0", "decode")}
        assert deregister(url, decode, "decode-0").status_code == 200
        assert instances(url, public) == {("relay-0", "relay")}
        for _ in range(3):  # no decode is registered: clients are refused, and nobody dials the fake
            reply = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, verify=public,
                               headers={"authorization": f"Bearer {CLIENT_KEY}"}, timeout=10.0)
            assert reply.status_code == 503
        assert not connected(fake)


def test_without_tls_registration_is_bound_to_the_key_and_its_roles(tmp_path: Path) -> None:
    keys = [{"name": "client", "key": CLIENT_KEY}, {"name": "decoders", "key": DECODE_KEY, "roles": ["decode"]},
            {"name": "relays", "key": RELAY_KEY, "roles": ["relay"]}]
    with listener() as fake, router(tmp_path, {"api_keys": keys}, True) as url:
        fake_url = f"http://127.0.0.1:{fake.getsockname()[1]}"
        assert refused(beat(url, True, "decode", "decode-0", fake_url))  # no key
        assert refused(beat(url, True, "decode", "decode-0", fake_url, CLIENT_KEY))  # a client's key
        assert refused(beat(url, True, "decode", "decode-0", fake_url, RELAY_KEY))  # a key of another role
        assert beat(url, True, "decode", "decode-0", fake_url, DECODE_KEY).status_code == 200
        assert refused(beat(url, True, "relay", "decode-0", fake_url, RELAY_KEY))  # taking over a live id
        assert refused(deregister(url, True, "decode-0", RELAY_KEY))
        assert refused(deregister(url, True, "decode-0"))
        assert instances(url, True) == {("decode-0", "decode")}
        assert deregister(url, True, "decode-0", DECODE_KEY).status_code == 200
        assert instances(url, True) == set()
        assert not connected(fake)


def test_key_roles_are_checked_and_instances_pick_their_own_key() -> None:
    from prfaas.errors import InvalidRequest
    from prfaas.security.apikeys import parse_keys
    from prfaas.security.registration import credential

    with pytest.raises(InvalidRequest, match="roles"):
        parse_keys([{"key": DECODE_KEY, "roles": ["router"]}])  # the router does not register
    legacy = parse_keys([CLIENT_KEY, DECODE_KEY])
    assert credential(legacy, "relay") == {"authorization": f"Bearer {CLIENT_KEY}"}  # configs from before roles
    keys = parse_keys([CLIENT_KEY, {"key": DECODE_KEY, "roles": ["decode"]}, {"key": RELAY_KEY, "roles": "relay"}])
    assert credential(keys, "decode") == {"authorization": f"Bearer {DECODE_KEY}"}
    assert credential(keys, "relay") == {"authorization": f"Bearer {RELAY_KEY}"}
    assert credential(keys, "prefill") == {}  # no key of its role: it registers with none and is refused
    assert credential([], "decode") == {}


def test_with_tls_on_but_not_required_a_peer_without_a_certificate_cannot_register() -> None:
    """TLS that is not required still admits clients without certificates (and lets the router bind a public
    port): without keys, such a peer has proved nothing and must not register (a loopback router without TLS is
    the one open case)."""
    from prfaas.errors import KVUnauthorized
    from prfaas.security.identity import Peer
    from prfaas.security.registration import OPEN, Registrar

    anonymous = Peer(None, "", "203.0.113.9:4000")
    with pytest.raises(KVUnauthorized):
        Registrar(tls=True).claim(anonymous, "", "decode", "decode-0")
    with pytest.raises(KVUnauthorized):
        Registrar(tls=True).identify(anonymous, "")
    assert Registrar(tls=False).claim(anonymous, "", "decode", "decode-0") == OPEN
    assert Registrar(tls=True).claim(Peer("decode", "decode", "x"), "", "decode", "decode-0") == "cert:decode/decode"
