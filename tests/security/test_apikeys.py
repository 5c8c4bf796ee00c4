"""Public API keys on the router, and the refusal to expose a router without keys or TLS."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from typing import Any

import httpx
import pytest

from prfaas.config import from_dict
from prfaas.errors import InvalidRequest
from prfaas.security.apikeys import check_exposure, parse_keys
from prfaas.services.router import Router, create_app

ALICE, BOB = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef00"


async def get(app: Any, headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.get("/v1/models", headers=headers)


def test_keys_names_and_rate_limits(caplog: pytest.LogCaptureFixture) -> None:
    config = from_dict({"api_keys": [ALICE, {"name": "bob", "key": BOB, "rate_limit_qps": 0.5}]})
    app = create_app(Router(config))

    async def scenario() -> list[httpx.Response]:
        return [await get(app, h) for h in (
            {}, {"Authorization": "Bearer sk-wrong-0123456789abcdef"}, {"Authorization": f"Basic {ALICE}"},
            {"Authorization": f"Bearer {ALICE}"}, {"Authorization": f"Bearer {BOB}"},
            {"Authorization": f"Bearer {BOB}"}, {"Authorization": f"Bearer {ALICE}"})]

    with caplog.at_level(logging.INFO):
        replies = asyncio.run(scenario())
    assert [r.status_code for r in replies] == [401, 401, 401, 200, 200, 429, 200]
    error = replies[0].json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key" and error["message"]
    assert replies[5].headers["retry-after"] == "2" and replies[5].json()["error"]["code"] == "RATE_LIMITED"
    assert ALICE not in caplog.text and BOB not in caplog.text and "wrong" not in caplog.text
    assert "0123456789" not in repr(parse_keys(config.api_keys))


def test_no_keys_on_loopback_lets_requests_through() -> None:
    app = create_app(Router(from_dict({})))
    assert asyncio.run(get(app, {})).status_code == 200


def test_bad_key_config_is_refused() -> None:
    for bad in (["short"], [{"key": ALICE, "secret": 1}], [ALICE, ALICE]):
        with pytest.raises(InvalidRequest):
            parse_keys(bad)


def test_non_loopback_router_needs_keys_or_tls() -> None:
    with pytest.raises(InvalidRequest, match="--insecure"):
        check_exposure("0.0.0.0", from_dict({}))
    check_exposure("0.0.0.0", from_dict({"api_keys": [ALICE]}))
    check_exposure("0.0.0.0", from_dict({}), insecure=True)
    check_exposure("127.0.0.1", from_dict({}))
    check_exposure("::1", from_dict({}))
    run = subprocess.run([sys.executable, "-m", "prfaas", "serve", "router", "--host", "0.0.0.0", "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "refusing to bind the router to 0.0.0.0" in run.stderr


def test_world_readable_secrets_are_refused(tmp_path: Any) -> None:
    import os

    from prfaas import tls
    from prfaas.config import TLSConfig
    from prfaas.security import certs
    from prfaas.security.apikeys import check_config_file

    path = tmp_path / "prfaas.yaml"
    path.write_text(f"api_keys: [{ALICE}]\n")
    config = from_dict({"api_keys": [ALICE]})
    os.chmod(path, 0o644)
    with pytest.raises(InvalidRequest, match="world-readable"):
        check_config_file(str(path), config)
    os.chmod(path, 0o600)
    check_config_file(str(path), config)
    certs.init(tmp_path / "pki")
    os.chmod(tmp_path / "pki" / "relay.key", 0o644)
    with pytest.raises(InvalidRequest, match="readable by others"):
        tls.client_context(TLSConfig(ca=str(tmp_path / "pki" / "ca.pem"), cert=str(tmp_path / "pki" / "relay.pem"),
                                     key=str(tmp_path / "pki" / "relay.key")))
