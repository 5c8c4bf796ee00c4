"""Store fixtures: a real ``redis-server`` for the session (stopped at the end, and checked to be gone), and
``make_store`` that builds a ``BlobStore`` on each backend, so one suite runs against both."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from prfaas.store import BlobStore
from prfaas.store.redis_backend import RedisBackend

BACKENDS = ["memory", "redis"]
MISSING = "redis-server is not installed: `bash scripts/install-system-deps.sh` (root + apt-get) installs it"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server on a unix socket: no persistence, 256 MiB, ``noeviction``."""
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail(MISSING)  # CI runs the set-up as root: a missing server is a set-up bug there
        pytest.skip(MISSING)
    folder = tmp_path_factory.mktemp("redis")
    sock = folder / "redis.sock"
    proc = subprocess.Popen([exe, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
                             "--save", "", "--appendonly", "no", "--dir", str(folder), "--maxmemory", "256mb",
                             "--maxmemory-policy", "noeviction"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_for(sock, proc)
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.poll() is not None, "redis-server is still running"


def _wait_for(sock: Path, proc: subprocess.Popen[bytes]) -> None:
    import redis

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        if sock.exists():
            try:
                redis.Redis(unix_socket_path=str(sock)).ping()
                return
            except redis.exceptions.RedisError:
                pass
        time.sleep(0.02)
    raise RuntimeError("redis-server did not start within 10 s")


StoreFactory = Callable[..., BlobStore]


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(request: pytest.FixtureRequest, backend_name: str) -> Iterator[StoreFactory]:
    """``make_store(budget, ttl, **BlobStore kwargs)`` on this test's backend; ``prefix=`` reuses a Redis
    namespace (a restarted store). Afterwards no Redis key may be left under the test's prefixes."""
    prefixes: list[str] = []
    url = request.getfixturevalue("redis_url") if backend_name == "redis" else ""

    def make(budget: int, ttl: float, prefix: str | None = None, **kwargs: Any) -> BlobStore:
        if backend_name == "redis":
            prefix = prefix or f"prfaas:test:{uuid.uuid4().hex[:12]}:"
            prefixes.append(prefix)
            kwargs["backend"] = RedisBackend(url, prefix)
        return BlobStore(budget, ttl, **kwargs)

    yield make
    if url:
        import redis

        client = redis.Redis.from_url(url)
        left = [k for p in set(prefixes) for k in client.scan_iter(match=p + "*")]
        client.delete(*left) if left else None
        client.close()
        assert not left, f"Redis keys left behind: {left[:5]}"
