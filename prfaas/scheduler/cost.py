"""The online offload cost model: a request's predicted TTFT on the remote route and on the local route.

    remote = pool queue wait + remote prefill(l) + exposed transfer + restore
    local  = decode instance's queue wait + local prefill(l)

The exposed transfer follows the layer-wise stream: the KV leaves the prefill instance while it is computed, behind
the bytes already in flight on the link; what is left when the forward pass ends is exposed:

    finish  = max(queue + prefill + chunk / B,  max(in_flight / B, queue) + kv / B) + RTT / 2
    exposed = finish − (queue + prefill)

with ``B`` the link's available bandwidth (bytes/s) and ``kv`` the blob's bytes after its codec. Pure functions
over one ``Inputs`` snapshot: no I/O, no clock; the ``Scheduler`` gathers the inputs, the simulated benchmark
feeds the same functions.

The deciding term (``Verdict.code``, a fixed vocabulary safe as a metric label) is the term whose difference
between the routes is largest in the direction the decision went: ``cost_queue`` (the queue waits),
``cost_prefill`` (the prefill times), ``cost_transfer`` (the exposed transfer plus restore, which only the remote
route pays).
"""

from __future__ import annotations

from dataclasses import dataclass

REMOTE, LOCAL = "remote", "local"
COST_CODES = ("cost_queue", "cost_prefill", "cost_transfer")


@dataclass(frozen=True)
class LinkView:
    """What the model knows about one link when it decides."""

    bandwidth_bps: float  # available bandwidth, bits/s (the link's measured estimate)
    inflight_bytes: float = 0.0  # KV bytes routed over it and not yet delivered
    chunk_bytes: int = 4 << 20
    rtt_s: float = 0.0


@dataclass(frozen=True)
class Inputs:
    kv_bytes: float  # this request's blob, after its codec
    remote_queue_s: float
    remote_prefill_s: float
    restore_s: float
    local_queue_s: float
    local_prefill_s: float


@dataclass(frozen=True)
class Verdict:
    route: str
    code: str
    remote_s: float
    local_s: float
    exposed_s: float

    def explain(self) -> str:
        return (f"predicted TTFT remote {self.remote_s * 1e3:.0f} ms (exposed transfer {self.exposed_s * 1e3:.0f} "
                f"ms) vs local {self.local_s * 1e3:.0f} ms")


def exposed_s(kv_bytes: float, queue_s: float, prefill_s: float, link: LinkView) -> float:
    """Seconds of the transfer left after the forward pass ends (see the module doc)."""
    rate = max(link.bandwidth_bps, 1.0) / 8
    last = min(float(link.chunk_bytes), kv_bytes) / rate
    finish = max(queue_s + prefill_s + last, max(link.inflight_bytes / rate, queue_s) + kv_bytes / rate)
    return finish + link.rtt_s / 2 - (queue_s + prefill_s)


def decide(inputs: Inputs, link: LinkView) -> Verdict:
    """The route with the lower predicted TTFT (remote on a tie: it frees the decode instance's compute)."""
    exposed = exposed_s(inputs.kv_bytes, inputs.remote_queue_s, inputs.remote_prefill_s, link)
    remote = inputs.remote_queue_s + inputs.remote_prefill_s + exposed + inputs.restore_s
    local = inputs.local_queue_s + inputs.local_prefill_s
    gains = {"cost_queue": inputs.local_queue_s - inputs.remote_queue_s,
             "cost_prefill": inputs.local_prefill_s - inputs.remote_prefill_s,
             "cost_transfer": -(exposed + inputs.restore_s)}
    route = REMOTE if remote <= local else LOCAL
    pick = max if route == REMOTE else min
    code = pick(gains, key=lambda k: gains[k])
    return Verdict(route, code, remote, local, exposed)


def utilisation(started_bytes: float, window_s: float, bandwidth_bps: float) -> float:
    """The fraction of the link's bandwidth the KV bytes started over the last ``window_s`` use."""
    return 8 * started_bytes / (max(window_s, 1e-9) * max(bandwidth_bps, 1.0))
