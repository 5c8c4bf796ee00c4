from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest

from prfaas.config import Config, TLSConfig
from prfaas.security import certs, runtime


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


@pytest.fixture
def as_role(pki: Path) -> Iterator[object]:
    """Configure this process's TLS as a role (``as_role("relay")``); reset to plaintext afterwards."""
    def configure(role: str, required: bool = True, crl: str | None = None, **extra: object) -> Config:
        config = Config(tls=tls_config(pki, role, required, crl=crl), **extra)  # type: ignore[arg-type]
        runtime.configure(config, role)
        return config

    yield configure
    runtime.configure(Config(), "none")
