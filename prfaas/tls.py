"""TLS 1.3 contexts for prfaas's servers and clients, from the config's ``tls: {ca, cert, key, required}``.

Both sides: minimum TLS 1.3, the private CA as the only trust anchor, this process's certificate presented.
Servers verify client certificates against the CA: required (``CERT_REQUIRED``) on instances when
``tls.required``, optional on the router's public port (OpenAI clients carry API keys, not certificates).
A plaintext peer fails the handshake, so nothing it sends is read as a request. With ``tls.crl`` (the CA's
revocation list, ``prfaas certs revoke``) both sides check the peer's certificate against it
(``VERIFY_CRL_CHECK_LEAF``): a revoked certificate fails the handshake. Failures: a missing or unreadable file
raises ``InvalidRequest`` naming it.

Revocation without restarts: every context that checks a list is remembered (weakly), and ``reload_crls`` loads a
list again into all of them once the file changed (inode, size or modification time). OpenSSL keeps both lists
and checks each peer against the newest valid one (latest ``lastUpdate``; ``certs.revoke`` makes each list's later
than the last), so the next handshake — TLS or HTTPS, client or server — sees the new list; connections already
open stay up. ``watch_crls`` runs ``reload_crls`` every ``CRL_CHECK_S`` seconds on a daemon thread
(``runtime.Security.of`` starts it when ``tls.crl`` is set). A list that cannot be read or parsed (half copied, say)
is logged and tried again at the next check; the one loaded stays in force meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import threading
import time
import weakref
from dataclasses import dataclass

from prfaas.errors import InvalidRequest

log = logging.getLogger("prfaas.security")
CRL_CHECK_S = 5.0
_CRL_CONTEXTS: weakref.WeakKeyDictionary[ssl.SSLContext, str] = weakref.WeakKeyDictionary()  # context → list
_CRL_LOADED: dict[str, tuple[int, int, int] | None] = {}  # list → (inode, mtime_ns, size) the contexts hold
_CRL_LOCK = threading.Lock()
_WATCHER: list[threading.Thread] = []


@dataclass(frozen=True)
class TLSConfig:
    """The config key ``tls`` (``prfaas.config.Config.tls``); defined here so that building a context needs
    nothing above this module."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    required: bool = False
    crl: str | None = None  # `prfaas certs revoke` writes it; peers' certificates are checked against it


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


CA_ENV = "PRFAAS_CA"


def https_verify(ca: str | None) -> ssl.SSLContext | bool:
    """What a command-line client trusts over HTTPS (``--ca`` / ``$PRFAAS_CA``): the CA in ``ca`` (the ``ca.pem``
    of ``prfaas certs init``, or the one ``prfaas up --tls`` prints) added to the system's trust store, or that
    store alone (``True``; it honours ``SSL_CERT_FILE``). An unreadable file raises ``InvalidRequest``."""
    if not ca:
        return True
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidRequest(f"cannot read the CA file {ca!r} (--ca, ${CA_ENV}): {exc}") from exc


def handshake_hint(exc: BaseException) -> str:
    """Why a client's connection failed, when TLS is why (`` (TLS: …)``, else ''): an untrusted certificate is a
    missing ``--ca``, not a dead server."""
    cause: BaseException | None = exc
    for _ in range(6):  # httpx → httpcore → ssl: the TLS error sits a few links down the chain
        if cause is None or isinstance(cause, ssl.SSLError):
            break
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f" (TLS: {cause.verify_message}; give the server's CA with --ca or ${CA_ENV})"
    if isinstance(cause, ssl.SSLError):
        return f" (TLS: {cause.reason or cause})"
    return ""


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
    with _CRL_LOCK:
        _CRL_CONTEXTS[ctx] = crl
        _CRL_LOADED.setdefault(crl, _stamp(crl))  # an older stamp only makes the next check load it once more


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def reload_crls() -> list[str]:
    """Load every revocation list whose file changed into the contexts that check it; returns the lists loaded."""
    loaded: list[str] = []
    with _CRL_LOCK:
        by_list: dict[str, list[ssl.SSLContext]] = {}
        for ctx, crl in list(_CRL_CONTEXTS.items()):
            by_list.setdefault(crl, []).append(ctx)
        for crl, contexts in by_list.items():
            stamp = _stamp(crl)
            if stamp is None or stamp == _CRL_LOADED.get(crl):
                continue
            try:
                for ctx in contexts:  # adding a list twice is harmless, so a retry may start over
                    ctx.load_verify_locations(cafile=crl)
            except (OSError, ssl.SSLError) as exc:
                log.warning("tls: cannot reload the revocation list %s (%s); the one loaded stays in force", crl, exc)
                continue
            _CRL_LOADED[crl] = stamp
            loaded.append(crl)
            log.info("tls: revocation list %s reloaded into %d contexts", crl, len(contexts))
    return loaded


def watch_crls(interval_s: float = CRL_CHECK_S) -> None:
    """Run ``reload_crls`` every ``interval_s`` on one daemon thread for the life of the process (idempotent)."""
    with _CRL_LOCK:
        if _WATCHER:
            return
        _WATCHER.append(threading.Thread(target=_watch, args=(interval_s,), name="prfaas-crl-watch", daemon=True))
    _WATCHER[0].start()


def _watch(interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        try:
            reload_crls()
        except Exception:  # the watcher must outlive any one bad check
            log.exception("tls: revocation list check failed")


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
