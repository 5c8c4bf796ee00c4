"""A role's TLS settings are a value it holds (``Security``), not process state: two roles in one process keep
their own, and a role that requires TLS without its files is refused when its settings are built."""

from __future__ import annotations

from pathlib import Path

import pytest

from prfaas.config import Config, TLSConfig
from prfaas.errors import InvalidRequest
from prfaas.security.runtime import PLAINTEXT, Security
from tests.security.conftest import tls_config


def test_two_roles_in_one_process_keep_their_own_tls(pki: Path) -> None:
    relay = Security.of(Config(tls=tls_config(pki, "relay")), "relay")
    router = Security.of(Config(), "router")  # built after the relay's: still plaintext
    assert router is PLAINTEXT and router.scheme() == "http" and router.http_verify() is True
    assert router.client_ssl() is None and router.server_ssl() is None and not router.required()
    assert relay.scheme() == "https" and relay.required() and relay.client_ssl() is not None
    assert relay.server_ssl() is not None and relay.role == "relay"


def test_required_tls_without_its_files_is_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"tls\.required"):
        Security.of(Config(tls=TLSConfig(required=True)), "decode")
