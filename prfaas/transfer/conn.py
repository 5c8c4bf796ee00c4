"""Connections for the data plane: addresses, socket options, and the one place where transport errors become
prfaas errors.

    asyncio.TimeoutError / TimeoutError            → KVTimeout      (the peer or the blob missed a deadline)
    refused / unreachable at connect               → KVUnavailable
    asyncio.IncompleteReadError, reset, broken pipe → KVTruncated    (resume on a new connection)
    ssl.SSLCertVerificationError                   → KVUnauthorized
    a TLS alert refusing our certificate           → KVUnauthorized (expired, revoked, unknown CA, none sent)
    other ssl.SSLError                             → KVTruncated
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl as ssl_module
from collections.abc import Iterator

from prfaas.errors import InvalidRequest, KVTimeout, KVTruncated, KVUnauthorized, KVUnavailable, PrfaasError
from prfaas.transfer import tcp
from prfaas.transfer.wire import Conn

REFUSED_ALERTS = frozenset({  # TLS alerts a server sends when it refuses the client's certificate
    "SSLV3_ALERT_CERTIFICATE_EXPIRED", "SSLV3_ALERT_CERTIFICATE_REVOKED", "TLSV1_ALERT_UNKNOWN_CA",
    "SSLV3_ALERT_BAD_CERTIFICATE", "SSLV3_ALERT_CERTIFICATE_UNKNOWN", "TLSV13_ALERT_CERTIFICATE_REQUIRED",
    "TLSV1_ALERT_ACCESS_DENIED"})


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) → ``(host, port)``; ``InvalidRequest`` if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequest(f"bad data-plane address {address!r}; expected HOST:PORT")
    return host.strip("[]"), int(port)


async def connect(address: str, ssl: ssl_module.SSLContext | None, timeout_s: float,
                  bandwidth_bps: float | None = None, rtt_s: float | None = None,
                  unsent_bytes: int | None = None) -> Conn:
    """Open a connection (TLS handshake included) within ``timeout_s``; ``KVUnavailable`` if the peer cannot be
    reached, ``KVUnauthorized`` if its TLS certificate is not trusted. Socket options follow ``tcp.tune``."""
    host, port = split_address(address)
    try:
        async with asyncio.timeout(timeout_s):
            conn = await Conn.open(host, port, ssl, lambda sock: tcp.tune(sock, bandwidth_bps, rtt_s, unsent_bytes))
    except ssl_module.SSLCertVerificationError as exc:
        raise KVUnauthorized(f"TLS peer {address} not trusted: {exc.verify_message}") from exc
    except (OSError, TimeoutError, ssl_module.SSLError) as exc:
        raise KVUnavailable(f"data-plane peer {address} unreachable: {exc!r}") from exc
    return conn


@contextlib.contextmanager
def mapped(what: str) -> Iterator[None]:
    """Turn transport errors raised inside the block into prfaas errors (see the module docstring)."""
    try:
        yield
    except PrfaasError:
        raise
    except TimeoutError as exc:
        raise KVTimeout(f"{what}: deadline passed") from exc
    except ssl_module.SSLCertVerificationError as exc:
        raise KVUnauthorized(f"{what}: TLS peer not trusted") from exc
    except ssl_module.SSLError as exc:
        if exc.reason in REFUSED_ALERTS:
            raise KVUnauthorized(f"{what}: the peer refused our certificate ({exc.reason})") from exc
        raise KVTruncated(f"{what}: connection ended early ({type(exc).__name__})") from exc
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise KVTruncated(f"{what}: connection ended early ({type(exc).__name__})") from exc
    except OSError as exc:
        raise KVTruncated(f"{what}: {exc!r}") from exc


async def close(conn: Conn) -> None:
    """Close a connection (never blocks: the socket is simply closed)."""
    conn.close()
