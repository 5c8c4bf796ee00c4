"""Connections for the data plane: addresses, socket options, and the one place where transport errors become
prfaas errors.

    asyncio.TimeoutError / TimeoutError            → KVTimeout      (the peer or the blob missed a deadline)
    refused / unreachable at connect               → KVUnavailable
    asyncio.IncompleteReadError, reset, broken pipe → KVTruncated    (resume on a new connection)
    ssl.SSLCertVerificationError                   → KVUnauthorized
    other ssl.SSLError                             → KVTruncated
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl as ssl_module
from collections.abc import Iterator

from prfaas.errors import InvalidRequest, KVTimeout, KVTruncated, KVUnauthorized, KVUnavailable, PrfaasError

STREAM_LIMIT = 2 << 20  # asyncio's read buffer: above one chunk, so a 1 MiB chunk arrives without pausing reads
SOCKET_BUFFER = 4 << 20


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) → ``(host, port)``; ``InvalidRequest`` if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequest(f"bad data-plane address {address!r}; expected HOST:PORT")
    return host.strip("[]"), int(port)


def tune(writer: asyncio.StreamWriter) -> None:
    """No Nagle delay for small control frames; large buffers so a chunk fits in flight."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


async def connect(address: str, ssl: ssl_module.SSLContext | None,
                  timeout_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a connection within ``timeout_s``; ``KVUnavailable`` if the peer cannot be reached."""
    host, port = split_address(address)
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port, ssl=ssl, limit=STREAM_LIMIT)
    except ssl_module.SSLCertVerificationError as exc:
        raise KVUnauthorized(f"TLS peer {address} not trusted: {exc.verify_message}") from exc
    except (OSError, TimeoutError) as exc:
        raise KVUnavailable(f"data-plane peer {address} unreachable: {exc!r}") from exc
    tune(writer)
    return reader, writer


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
    except (asyncio.IncompleteReadError, ConnectionError, ssl_module.SSLError) as exc:
        raise KVTruncated(f"{what}: connection ended early ({type(exc).__name__})") from exc
    except OSError as exc:
        raise KVTruncated(f"{what}: {exc!r}") from exc


async def close(writer: asyncio.StreamWriter) -> None:
    """Close a connection without waiting long for a peer that does not answer."""
    writer.close()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await writer.wait_closed()
