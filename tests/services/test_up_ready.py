"""``prfaas up`` says it is up only once every instance it started is healthy at its router, not when the router's
``/health`` first turns ready (one instance of each role): a client that goes straight to the second decode
instance, say, finds it serving. A stand-in router answers ``/health``; nothing else is started."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from prfaas.services.up import SHARED_SPIN, Deployment, UpOptions, shared_cores_env


class _Health(BaseHTTPRequestHandler):
    body: ClassVar[dict[str, Any]] = {}

    def do_GET(self) -> None:
        data = json.dumps(self.body).encode()
        self.send_response(200 if self.body.get("ready") else 503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def router() -> Iterator[tuple[str, type[_Health]]]:
    handler = type("Health", (_Health,), {"body": {}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.parametrize(("mode", "healthy", "up"), [
    ("direct", {"prefill": 1, "decode": 1}, False),  # the router is ready; the second decode is still starting
    ("direct", {"prefill": 1, "decode": 2}, True),
    ("relay", {"prefill": 1, "decode": 2}, False),
    ("relay", {"prefill": 1, "decode": 2, "relay": 1}, True),
])
def test_up_waits_for_every_instance_it_started(router: tuple[str, type[_Health]], mode: str,
                                                 healthy: dict[str, int], up: bool) -> None:
    url, handler = router
    handler.body = {"ready": True, "mode": mode, "healthy": healthy}
    assert Deployment(UpOptions(mode=mode, decode=2))._healthy(url) is up


def test_a_router_that_is_not_ready_is_not_up(router: tuple[str, type[_Health]]) -> None:
    url, handler = router
    handler.body = {"ready": False, "mode": "direct", "healthy": {"prefill": 0, "decode": 2}}
    assert not Deployment(UpOptions(mode="direct", decode=2))._healthy(url)


def test_a_router_still_loading_its_own_tokenizer_is_not_up(router: tuple[str, type[_Health]]) -> None:
    """Its first requests would share the cores with the load (transformers' import: seconds of CPU)."""
    url, handler = router
    handler.body = {"ready": True, "mode": "direct", "healthy": {"prefill": 1, "decode": 1}, "tokenizers_loading": 1}
    assert not Deployment(UpOptions(mode="direct"))._healthy(url)
    handler.body = {**handler.body, "tokenizers_loading": 0}
    assert Deployment(UpOptions(mode="direct"))._healthy(url)


def test_engine_children_spin_briefly_unless_told_otherwise() -> None:
    """Every engine of ``prfaas up`` shares the machine's cores: libgomp's default spin-wait lets a busy one's
    workers hold cores another busy one needs, so the children get a short spin (docs/engine.md, Threads); a spin
    policy the caller set wins, and vLLM's engines keep their own."""
    base = {"PATH": "/usr/bin"}
    assert shared_cores_env(base, "prfaas") == {"PATH": "/usr/bin", "GOMP_SPINCOUNT": SHARED_SPIN}
    assert shared_cores_env({**base, "GOMP_SPINCOUNT": "0"}, "prfaas") is None
    assert shared_cores_env({**base, "OMP_WAIT_POLICY": "ACTIVE"}, "prfaas") is None
    assert shared_cores_env(base, "vllm") is None
