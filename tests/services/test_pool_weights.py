"""Pool weights survive a router restart (``pool_weights_file``): an admin change is kept before it is applied, a
new router layers the file over the config's ``pools``, an unwritable file refuses the change and applies nothing,
an unreadable one refuses the start."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from prfaas.cli import app
from prfaas.config import from_dict
from prfaas.errors import InvalidRequest
from prfaas.services.router import Router, create_app
from tests.services.deploy import free_port


def _post(router: Router, weights: dict[str, Any]) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(router))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/admin/pools", json={"weights": weights})

    return asyncio.run(call())


def test_weights_set_through_the_admin_api_survive_a_restart(tmp_path: Path) -> None:
    config = from_dict({"pools": {"m": 100}, "pool_weights_file": str(tmp_path / "weights.json")})
    reply = _post(Router(config), {"40ddcb38fdac": 100, "m": 0})
    assert reply.status_code == 200 and reply.json()["kept_in"] == config.pool_weights_file
    assert json.loads((tmp_path / "weights.json").read_text())["weights"] == {"40ddcb38fdac": 100, "m": 0}
    restarted = Router(config)  # the file is newer than the config: its entries win, the config's others stay
    assert restarted.registry.pools == {"40ddcb38fdac": 100, "m": 0}
    _post(restarted, {"c4d3ddd41928": 10})
    assert Router(config).registry.pools == {"40ddcb38fdac": 100, "m": 0, "c4d3ddd41928": 10}
    assert [p.name for p in tmp_path.iterdir()] == ["weights.json"]  # no temporary file left behind


def test_without_the_file_weights_live_in_memory_only(tmp_path: Path) -> None:
    config = from_dict({"pools": {"m": 100}})
    assert _post(Router(config), {"m": 5}).json()["kept_in"] is None
    assert Router(config).registry.pools == {"m": 100}


def test_a_change_that_cannot_be_kept_is_refused_and_not_applied(tmp_path: Path) -> None:
    config = from_dict({"pools": {"m": 100}, "pool_weights_file": str(tmp_path / "missing-dir" / "weights.json")})
    router = Router(config)
    reply = _post(router, {"m": 0})
    assert reply.status_code == 500 and "nothing changed" in reply.json()["error"]["message"]
    assert router.registry.pools == {"m": 100}


@pytest.mark.parametrize("content", ["{not json", '{"weights": [1]}', '{"other": {}}', '{"weights": {"m": -1}}'])
def test_an_unreadable_file_refuses_the_start_naming_it(tmp_path: Path, content: str) -> None:
    path = tmp_path / "weights.json"
    path.write_text(content)
    with pytest.raises(InvalidRequest, match=f"pool_weights_file {path}"):
        Router(from_dict({"pool_weights_file": str(path)}))


def test_a_restarted_router_process_keeps_the_canary_weights(tmp_path: Path) -> None:
    """The real thing: `prfaas serve router`, `prfaas admin weight`, SIGTERM, a new router on the same config."""
    config = tmp_path / "prfaas.yaml"
    config.write_text(f"pools: {{m: 100}}\npool_weights_file: {tmp_path / 'weights.json'}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _router(port, config):
        out = CliRunner().invoke(app, ["admin", "weight", "m-v2", "5", "--admit", "--router", url])
        assert out.exit_code == 0 and f"weights kept in {tmp_path / 'weights.json'}" in out.output, out.output
    with _router(port, config):
        assert httpx.get(f"{url}/admin/pools", timeout=10).json()["configured"] == {"m": 100, "m-v2": 5}


@contextlib.contextmanager
def _router(port: int, config: Path) -> Iterator[None]:
    cmd = [sys.executable, "-m", "prfaas", "serve", "router", "--port", str(port), "--config", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr and proc.stderr.read()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/admin/pools", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        if proc.stderr:
            proc.stderr.close()
