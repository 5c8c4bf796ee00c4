from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import pytest

from prfaas.errors import KVUnauthorized
from prfaas.kv import BlobReader
from prfaas.store import BlobStore
from prfaas.transfer import TransferServer, pull, push, release
from tests.transfer.helpers import assert_clean, assert_same, blob_frames, make_state, run

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def contexts(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext, ssl.SSLContext]:
    cert, key = self_signed(tmp_path, "relay")
    other, _ = self_signed(tmp_path, "stranger")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_3
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(cert))
    client.minimum_version = ssl.TLSVersion.TLSv1_3
    wrong = ssl.create_default_context(cafile=str(other))
    return server, client, wrong


def test_tls13_round_trip_and_untrusted_peer(tmp_path: Path) -> None:
    server_ctx, client_ctx, wrong_ctx = contexts(tmp_path)
    state = make_state()
    kv_id, frames = blob_frames(state)

    async def scenario() -> None:
        store = BlobStore(64 << 20, 120)
        server = TransferServer(store, ssl=server_ctx)
        address = f"127.0.0.1:{await server.start()}"
        await push(address, kv_id, frames, ssl=client_ctx, timeout_s=5.0)
        assert_same(state, await pull(address, kv_id, BlobReader(), ssl=client_ctx, timeout_s=5.0))
        with pytest.raises(KVUnauthorized):
            await pull(address, kv_id, BlobReader(), ssl=wrong_ctx, timeout_s=5.0, retries=0)
        await release(address, kv_id, ssl=client_ctx)
        await server.close()
        assert_clean(store)

    run(scenario)
