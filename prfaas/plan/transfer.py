"""How long one KV blob takes to cross a link, as the data plane moves it: over a TCP connection of its own.

Every push opens a fresh connection (``prfaas.transfer.client.push``), so a blob pays the handshake and TCP's
slow start before it runs at the link's rate. The window starts at ``INITIAL_WINDOW`` segments and doubles every
round trip (Linux's IW10; BBR's start-up grows as fast) until it holds the bandwidth-delay product; the rest
goes at the rate the link leaves free; the last byte then needs half a round trip to arrive::

    wire(kv) = RTT (handshake) + k × RTT (the k rounds whose window is below the BDP)
               + (kv − bytes of those rounds) / B + RTT / 2

On a long fat link the rounds dominate small blobs: 1 Gbit/s over 50 ms of RTT needs 9 rounds (0.45 s, 7.4 MB)
before the pipe is full, so a 31.2 MB blob takes 0.72 s, not the 0.25 s of bytes over bandwidth.

The serving path around it (docs/planning.md): prefill starts computing when the request reaches it and encodes
each layer's chunks on its engine thread as the layer finishes, so the instance's prefill (the ``prefill_ms`` stage
it reports) is the forward pass plus the encoding (``encode_ms``, timed by ``prfaas measure``), and in relay mode
longer while the push holds more than its slack the link has not taken. Decode's ``transfer_ms`` stage
starts when decode hears of the request, which is when prefill answers the router:

- relay mode: prefill pushes to the relay beside decode; the push's handshake and the header's round trip (the
  relay acknowledges a created blob before any chunk goes) come first, and prefill answers once the blob exists,
  half a round trip from the router, so decode starts 2.5 RTT after prefill;
- direct mode: prefill answers at once (the blob is in its own store) and decode pulls across the link, its
  request reaching prefill's store half a round trip after its own handshake.

The push's slack is its queue, ``PUSH_QUEUE_BYTES``, plus what its kernel may hold written and not yet sent,
``UNSENT_BYTES`` (``prfaas.transfer.tcp``). The engine's last chunk goes into the queue once all but the slack has
been sent, half a round trip before it has all arrived.

With ``made`` the queue and the instance's prefill (when the last chunk exists), from the request reaching
prefill::

    relay:  stage = max(made + chunk / B + RTT / 2,  wire(kv) + RTT) − 2.5 RTT
    direct: stage = max(made + chunk / B,             wire(kv) + RTT / 2)
    exposed = max(0, stage − queue − prefill (as the instance reports it))   (the router's metric is clamped too)

Pure functions of the link and the sizes: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INITIAL_WINDOW = 10  # segments (RFC 6928, Linux's default initial congestion window)
TCP_IP_OVERHEAD = 52  # IPv4 20 + TCP 20 + timestamps 12
CHUNK_BYTES = 1 << 20  # the data plane's default chunk (prfaas.kv.state.DEFAULT_CHUNK_BYTES)
PUSH_QUEUE_BYTES = 64 << 20  # what a push holds that the link has not taken (prfaas.services.sinks.PUSH_QUEUE_BYTES)
UNSENT_BYTES = 4 << 20  # what its kernel may hold written and not yet sent (prfaas.transfer.tcp.UNSENT_BYTES)
PUSH_SLACK_BYTES = PUSH_QUEUE_BYTES + UNSENT_BYTES
MODES = ("relay", "direct")


def wire_ms(nbytes: float, rate_bps: float, rtt_ms: float, mtu: int = 1500) -> float:
    """Milliseconds for ``nbytes`` over a new TCP connection at ``rate_bps`` and ``rtt_ms`` (see the module
    doc); infinite when nothing is left of the rate."""
    if rate_bps <= 0:
        return math.inf
    per_ms = rate_bps / 8 / 1e3
    bdp = per_ms * rtt_ms
    window, left, elapsed = float(INITIAL_WINDOW * (mtu - TCP_IP_OVERHEAD)), float(nbytes), rtt_ms
    while window < bdp and left > window:
        left -= window
        elapsed += rtt_ms
        window *= 2
    return elapsed + left / per_ms + rtt_ms / 2


@dataclass(frozen=True)
class Transfer:
    """One prompt length's predicted transfer (all milliseconds): the blob's bytes; the forward pass and the
    encoding of its chunks; the prefill the instance reports (``instance_prefill_ms``: both, or longer while a push
    holds it back); the wire time alone; the stage decode measures and its exposed part."""

    seq_len: int
    kv_bytes: int
    prefill_ms: float
    encode_ms: float
    instance_prefill_ms: float
    wire_ms: float
    stage_ms: float
    exposed_ms: float


def predict(seq_len: int, kv_bytes: int, prefill_ms: float, rate_bps: float, rtt_ms: float, mtu: int = 1500,
            queue_ms: float = 0.0, chunk_bytes: int = CHUNK_BYTES, encode_ms: float = 0.0,
            mode: str = "relay") -> Transfer:
    """The serving path's transfer of one blob in ``mode`` (see the module doc)."""
    wire = wire_ms(kv_bytes, rate_bps, rtt_ms, mtu)
    last = min(chunk_bytes, kv_bytes) * 8 / rate_bps * 1e3 if rate_bps > 0 else math.inf
    busy = prefill_ms + encode_ms
    if mode == "relay":
        # the engine thread encodes its last chunk once all but the push's slack has left (sent: RTT / 2 early)
        if kv_bytes > PUSH_SLACK_BYTES:
            busy = max(busy, wire_ms(kv_bytes - PUSH_SLACK_BYTES, rate_bps, rtt_ms, mtu) + rtt_ms / 2 - queue_ms)
        stage = max(queue_ms + busy + last + rtt_ms / 2, wire + rtt_ms) - 2.5 * rtt_ms
    elif mode == "direct":
        stage = max(queue_ms + busy + last, wire + rtt_ms / 2)
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return Transfer(seq_len, kv_bytes, prefill_ms, encode_ms, busy, wire, stage, max(0.0, stage - queue_ms - busy))
