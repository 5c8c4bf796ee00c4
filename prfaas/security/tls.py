"""TLS 1.3 contexts for prfaas's servers and clients, from the config's ``tls: {ca, cert, key, required}``.

Both sides: minimum TLS 1.3, the private CA as the only trust anchor, this process's certificate presented.
Servers verify client certificates against the CA: required (``CERT_REQUIRED``) on instances when
``tls.required``, optional on the router's public port (OpenAI clients carry API keys, not certificates).
A plaintext peer fails the handshake, so nothing it sends is read as a request. With ``tls.crl`` (the CA's
revocation list, ``prfaas certs revoke``) both sides check the peer's certificate against it
(``VERIFY_CRL_CHECK_LEAF``): a revoked certificate fails the handshake. Failures: a missing or unreadable file
raises ``InvalidRequest`` naming it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl

from prfaas.config import TLSConfig
from prfaas.errors import InvalidRequest


def enabled(tls: TLSConfig) -> bool:
    """True when the config names a CA, a certificate and a key (TLS on every listener and client)."""
    return bool(tls.ca and tls.cert and tls.key)


def server_context(tls: TLSConfig, client_certs: bool | None = None) -> ssl.SSLContext:
    """A server context; ``client_certs`` True requires a client certificate, False only verifies one when
    presented, None follows ``tls.required``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _common(ctx, tls)
    required = tls.required if client_certs is None else client_certs
    ctx.verify_mode = ssl.CERT_REQUIRED if required else ssl.CERT_OPTIONAL
    return ctx


def client_context(tls: TLSConfig) -> ssl.SSLContext:
    """A client context that verifies the server against the CA (host names included) and presents our
    certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    _common(ctx, tls)
    return ctx


def _common(ctx: ssl.SSLContext, tls: TLSConfig) -> None:
    if not enabled(tls):
        raise InvalidRequest("tls: ca, cert and key must all be set")
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if os.path.exists(str(tls.key)) and os.stat(str(tls.key)).st_mode & 0o077:
        raise InvalidRequest(f"tls: the private key {tls.key} is readable by others; run `chmod 600 {tls.key}`")
    try:
        ctx.load_verify_locations(cafile=tls.ca)
        ctx.load_cert_chain(str(tls.cert), str(tls.key))
    except (OSError, ssl.SSLError) as exc:
        raise InvalidRequest(f"tls: cannot load {tls.ca}, {tls.cert} or {tls.key}: {exc}") from exc
    if tls.crl:
        _load_crl(ctx, tls.crl)


def _load_crl(ctx: ssl.SSLContext, crl: str) -> None:
    """Check every peer's certificate against the CA's revocation list (``prfaas certs revoke``)."""
    try:
        ctx.load_verify_locations(cafile=crl)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidRequest(f"tls: cannot load the revocation list {crl}: {exc}") from exc
    ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF


TLS_HANDSHAKE = b"\x16"  # the first byte of a TLS client's first record


async def first_byte(sock: socket.socket) -> bytes:
    """The peer's first byte on ``sock`` (non-blocking, nothing read yet), peeked, not consumed, so a handshake
    still reads it: ``TLS_HANDSHAKE`` for a TLS client, ``b""`` when the peer closed without sending."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_reader(sock.fileno(), _settle, ready)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())
    return sock.recv(1, socket.MSG_PEEK)


def _settle(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)
