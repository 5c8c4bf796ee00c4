"""Redis over TLS with ACL credentials: a ``rediss://`` backend verifies the server against the configured CA and
logs in as its ACL user; a wrong password, a plaintext client, an untrusted server and the disabled default user
are all refused (``KV_UNAVAILABLE``). Blobs go through sealed, as a deployment with a store key runs them."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from prfaas.errors import KVUnavailable
from prfaas.security import certs
from prfaas.store import BlobStore
from prfaas.store.redis_backend import RedisBackend
from prfaas.store.sealed import SealedBackend
from tests.services.deploy import free_port
from tests.store.conftest import MISSING
from tests.store.test_store import read_all
from tests.transfer.helpers import blob_frames, fill, make_state, run

PASSWORD = "s3cret-" + "p" * 20


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, Path]]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip(MISSING)
    folder = tmp_path_factory.mktemp("redis-tls")
    ca = certs.init(folder / "pki")["ca"]
    server = certs.issue(folder / "pki", "relay", "redis-server", hosts=["127.0.0.1", "localhost"])
    other_ca = certs.init(folder / "other")["ca"]
    port = free_port()
    proc = subprocess.Popen([
        exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file", str(server),
        "--tls-key-file", str(server.with_suffix(".key")), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
        "--save", "", "--appendonly", "no", "--dir", str(folder),
        "--user", "default", "off", "--user", "prfaas", "on", f">{PASSWORD}", "~prfaas:*", "+@all"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(port, ca, proc)
        yield port, ca, other_ca
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _wait(port: int, ca: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        try:
            RedisBackend(f"rediss://prfaas:{PASSWORD}@127.0.0.1:{port}/0", "prfaas:probe:", None, ca=str(ca)).close()
            return
        except KVUnavailable:
            time.sleep(0.05)
    raise RuntimeError("TLS redis-server did not start within 10 s")


def test_tls_and_acl_credentials_carry_sealed_blobs(tls_redis: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    port, ca, _ = tls_redis
    monkeypatch.setenv("PRFAAS_REDIS_PASSWORD", PASSWORD)  # out of the URL, as a deployment would keep it
    prefix = f"prfaas:test:{uuid.uuid4().hex[:8]}:"
    backend = RedisBackend(f"rediss://prfaas@127.0.0.1:{port}/0", prefix, ca=str(ca))
    store = BlobStore(64 << 20, 120, backend=SealedBackend(backend, bytes(32)))
    kv_id, frames = blob_frames(make_state())
    fill(store, kv_id, frames)
    assert run(lambda: read_all(store, kv_id)) == frames
    assert store.release(kv_id).key_destroyed
    assert backend.live_keys() == []
    store.close()


@pytest.mark.parametrize("case", ["wrong password", "plaintext", "untrusted server", "default user"])
def test_refused_connections(tls_redis: tuple, case: str) -> None:
    port, ca, other_ca = tls_redis
    url, trust = {
        "wrong password": (f"rediss://prfaas:wrong-{PASSWORD}@127.0.0.1:{port}/0", ca),
        "plaintext": (f"redis://prfaas:{PASSWORD}@127.0.0.1:{port}/0", ca),
        "untrusted server": (f"rediss://prfaas:{PASSWORD}@127.0.0.1:{port}/0", other_ca),
        "default user": (f"rediss://127.0.0.1:{port}/0", ca),
    }[case]
    with pytest.raises(KVUnavailable):
        RedisBackend(url, "prfaas:refused:", None, timeout_s=2.0, ca=str(trust))

