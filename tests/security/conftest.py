from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from prfaas.config import Config, TLSConfig
from prfaas.security import certs
from prfaas.security.runtime import Security


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA with one certificate per role, a stranger CA, an expired decode certificate and one without a role."""
    root = tmp_path_factory.mktemp("pki")
    certs.init(root)
    certs.issue(root, "decode", "decode-old", not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=10), days=2)
    certs.init(root / "stranger")
    return root


def tls_config(pki: Path, role: str, required: bool = True, ca: Path | None = None,
               crl: str | None = None) -> TLSConfig:
    return TLSConfig(ca=str(ca or pki / "ca.pem"), cert=str(pki / f"{role}.pem"), key=str(pki / f"{role}.key"),
                     required=required, crl=crl)


class Role(NamedTuple):
    """A role's config with TLS, and the ``Security`` built from it, which the test hands to what it starts."""

    config: Config
    security: Security


@pytest.fixture
def as_role(pki: Path) -> Iterator[object]:
    """A role's TLS settings (``as_role("relay")``): its config and its ``Security``."""
    def configure(role: str, required: bool = True, crl: str | None = None, **extra: object) -> Role:
        config = Config(tls=tls_config(pki, role, required, crl=crl)).replace(**extra)  # extra: flat YAML keys
        return Role(config, Security.of(config, role))

    yield configure
