"""``prfaas up --tls``: a throw-away CA and one certificate per role in a temporary directory, and one config file
per role (the user's config plus ``tls: {ca, cert, key, required: true}``), written 0600.

Ownership: the caller owns ``directory`` and removes it when the deployment stops (``shutil.rmtree``).
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

import yaml

from prfaas.config import load_config
from prfaas.security import certs


def tls_configs(directory: str | os.PathLike[str], base_config: str | None) -> dict[str, str]:
    """Make the CA and role certificates in ``directory``; returns role → config path (and ``ca`` → CA path)."""
    root = Path(directory)
    paths = certs.init(root)
    base: dict[str, Any] = yaml.safe_load(Path(base_config).read_text()) or {} if base_config else {}
    load_config(base_config)  # the user's file must be valid on its own
    out = {"ca": str(paths["ca"])}
    for role in certs.ROLES:
        tls = {"ca": str(paths["ca"]), "cert": str(paths[role]), "key": str(root / f"{role}.key"), "required": True}
        path = root / f"config-{role}.yaml"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump({**base, "tls": tls}, f)
        out[role] = str(path)
    return out


def ca_client_context(ca: str) -> ssl.SSLContext:
    """A TLS 1.3 client context trusting only ``ca`` (for talking to the router as a public client)."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx
