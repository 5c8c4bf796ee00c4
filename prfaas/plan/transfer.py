"""How long one KV blob takes to cross a link, as the data plane moves it: over a TCP connection of its own.

Every push opens a fresh connection (``prfaas.transfer.client.push``), so a blob pays the handshake and TCP's
slow start before it runs at the link's rate. The window starts at ``INITIAL_WINDOW`` segments and doubles every
round trip (Linux's IW10; BBR's start-up grows as fast) until it holds the bandwidth-delay product; the rest
goes at the rate the link leaves free; the last byte then needs half a round trip to arrive::

    wire(kv) = RTT (handshake) + k × RTT (the k rounds whose window is below the BDP)
               + (kv − bytes of those rounds) / B + RTT / 2

On a long fat link the rounds dominate small blobs: 1 Gbit/s over 50 ms of RTT needs 9 rounds (0.45 s, 7.4 MB)
before the pipe is full, so a 31.2 MB blob takes 0.72 s, not the 0.25 s of bytes over bandwidth.

The serving path around it (docs/planning.md): the router hands the request to prefill and decode at once;
prefill hears of it half a round trip later, waits in its queue, and streams chunks while it computes, so the
transfer as decode sees it (the ``transfer_ms`` stage) and its exposed part (what is left after the forward pass,
the ``prfaas_transfer_exposed_seconds`` metric) are::

    finish  = max(prefill + chunk / B + RTT / 2,  wire(kv))        from the start of prefill
    stage   = RTT / 2 + queue + finish
    exposed = stage − queue − prefill

Pure functions of the link and the sizes: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

INITIAL_WINDOW = 10  # segments (RFC 6928, Linux's default initial congestion window)
TCP_IP_OVERHEAD = 52  # IPv4 20 + TCP 20 + timestamps 12
CHUNK_BYTES = 4 << 20  # the data plane's default chunk (prfaas.kv.state.DEFAULT_CHUNK_BYTES)


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
    """One prompt length's predicted transfer: the blob's bytes, the wire time alone, the stage decode measures
    and its exposed part (all milliseconds)."""

    seq_len: int
    kv_bytes: int
    prefill_ms: float
    wire_ms: float
    stage_ms: float
    exposed_ms: float


def predict(seq_len: int, kv_bytes: int, prefill_ms: float, rate_bps: float, rtt_ms: float, mtu: int = 1500,
            queue_ms: float = 0.0, chunk_bytes: int = CHUNK_BYTES) -> Transfer:
    """The serving path's transfer of one blob (see the module doc)."""
    wire = wire_ms(kv_bytes, rate_bps, rtt_ms, mtu)
    last = min(chunk_bytes, kv_bytes) * 8 / rate_bps * 1e3 if rate_bps > 0 else math.inf
    finish = max(prefill_ms + last + rtt_ms / 2, wire)
    stage = rtt_ms / 2 + queue_ms + finish
    return Transfer(seq_len, kv_bytes, prefill_ms, wire, stage, stage - queue_ms - prefill_ms)


def predict_mix(lengths: tuple[int, ...], kv_bytes: Callable[[int], int], prefill_ms: Callable[[int], float],
                rate_bps: float, rtt_ms: float, mtu: int = 1500) -> list[Transfer]:
    """``predict`` for each length of a mix, prefill times from ``prefill_ms`` (zero without a profile: then
    nothing overlaps and the whole transfer is exposed)."""
    return [predict(n, kv_bytes(n), prefill_ms(n), rate_bps, rtt_ms, mtu) for n in lengths]
