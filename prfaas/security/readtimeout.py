"""Read timeouts for every prfaas HTTP server: a peer that trickles a request (slowloris) loses its connection.

uvicorn's h11 protocol only times out a connection that is idle *between* requests (``timeout_keep_alive``): once a
byte of a request has arrived, it waits for the rest for ever, so a few thousand peers sending one byte every few
seconds hold every connection slot. ``ReadTimeouts`` sits in front of uvicorn's ``H11Protocol`` (or the TLS
``PeerH11Protocol``) and follows the peer's h11 state after each read:

    IDLE, head begun          ── header_timeout_s, from the connection (or a later request's first byte) to the
                                 head's end
    IDLE between requests     ── uvicorn's own keep-alive timeout
    SEND_BODY                 ── body_timeout_s, from the head's end to the body's end
    anything else             ── no read timer: the app is answering, however long a generation takes

When a timer runs out the connection is answered ``408 REQUEST_TIMEOUT`` in the OpenAI error body (unless nothing
of a request came, or the app already began its reply) and closed; the request's app, if it was reading the body,
sees the client disconnect. Timeouts come from ``limits.header_timeout_ms`` and ``limits.body_timeout_ms``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from prfaas.errors import RequestTimeout
from prfaas.limits import WireLimits

log = logging.getLogger("prfaas.security")


class ReadTimeouts(H11Protocol):
    """The timers of the module docstring; ``timed`` binds them to a protocol class and the configured limits."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0
    _timer: asyncio.TimerHandle | None = None
    _phase = ""
    _raw: Any = None  # the TCP transport, before uvicorn has one (a TLS listener's handshake keeps the deadline itself)

    def connection_made(self, transport: Any) -> None:
        self._raw = transport
        self._arm("head")  # a connection that never completes a head (or never speaks) is timed too
        super().connection_made(transport)

    def handle_events(self) -> None:
        super().handle_events()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm("")
        super().connection_lost(exc)

    def _follow(self) -> None:
        state = self.conn.their_state
        phase = "body" if state is h11.SEND_BODY else ""
        if state is h11.IDLE and (self._phase == "head" or self.conn.trailing_data[0]):
            phase = "head"  # still the first head, or a byte of the next one came; else keep-alive's idle time
        if phase != self._phase:
            self._arm(phase)

    def _arm(self, phase: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._phase, self._timer = phase, None
        if phase:
            delay = self.header_timeout_s if phase == "head" else self.body_timeout_s
            self._timer = self.loop.call_later(delay, self._expired)

    def _expired(self) -> None:
        phase, self._timer = self._phase, None
        transport = self.transport or self._raw
        if transport is None or transport.is_closing():
            return
        seconds = self.header_timeout_s if phase == "head" else self.body_timeout_s
        error = RequestTimeout(f"the request {phase} did not arrive within {seconds:g} s")
        log.warning("closed a connection from %s: %s", _peer(transport), error.message)
        if self.transport is not None and self._answerable(phase):
            self.transport.write(_timeout_response(error))
        if self.cycle is not None:  # the app reading the body gets a disconnect; anything it sends is dropped
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        transport.close()

    def _answerable(self, phase: str) -> bool:
        if phase == "head":
            return bool(self.conn.trailing_data[0])  # part of a head came: say why it is closed
        return self.cycle is not None and not self.cycle.response_started


def timed(protocol: type[H11Protocol], limits: WireLimits) -> type[ReadTimeouts]:
    """``protocol`` (uvicorn's ``H11Protocol`` or a subclass) with the read timeouts of ``limits``."""
    bases = (ReadTimeouts,) if protocol is H11Protocol else (ReadTimeouts, protocol)
    return type(f"Timed{protocol.__name__}", bases, {"header_timeout_s": limits.header_timeout_ms / 1e3,
                                                      "body_timeout_s": limits.body_timeout_ms / 1e3})


def _timeout_response(error: RequestTimeout) -> bytes:
    body = json.dumps({"error": {"message": error.message, "type": "invalid_request_error", "code": error.code,
                                 "param": None}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


def _peer(transport: Any) -> str:
    peer = transport.get_extra_info("peername") or ("?", 0)
    return f"{peer[0]}:{peer[1]}"
