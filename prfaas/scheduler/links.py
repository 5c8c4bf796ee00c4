"""Per-link state: every (prefill datacenter, decode datacenter) pair is its own link.

Each ``Link`` holds its own health monitor (``LinkMonitor``: exposed-transfer P50/P99 and success rate; the
smoothed RTT and retransmissions of ``TCP_INFO`` where a transfer reports them), its own estimate of the available
bandwidth, the KV bytes the router has routed over it and not yet seen delivered, and the bytes started over the
last ``WINDOW_S`` (the utilisation the 70 % rule bounds). One link's bad transfers degrade that link only.

Bandwidth estimate: the link's provisioned bandwidth (``link_bandwidth_bps``) until a transfer shows less. A
transfer whose exposed part is longer than a few chunks' time was link-bound: the link could not keep up with the
layer-wise stream, so it was busy on this blob from the later of the stream's start (its forward pass's start) and
the link's previous delivery until now; the blob's bytes over that time are a sample of what the link delivers, and
the estimate moves toward it (EWMA 0.3). A transfer that kept up with its prefill only shows the link had room for
it, not how much: the estimate moves back toward the provisioned figure slowly (EWMA 0.03 a transfer: a link that
came back is found within some tens of transfers), so the spare capacity of a link run below its limit is not
mistaken for bandwidth it lost.

The 70 % rule, online (``Link.decide``), in two parts:
- *which requests*: over the last ``RANK_S``, the KV bytes of the requests the cost model would send remote are
  ranked by the local prefill seconds they save per byte (what a byte of the link buys: compute taken off the
  decode instances, for every request queued behind); the link's budget over that time, ``link_share`` ×
  estimated bandwidth × ``RANK_S``, goes to the highest savings first, and a request outside it stays local
  (``link_busy``). While every candidate fits, nothing is refused; when the link is short, the prompts that save
  least per byte (short ones: a blob has a fixed part) are the first kept local, which is how the online threshold
  rises with load. Not the TTFT difference: with a long local queue it is about the same for every prompt, and per
  byte it would favour the short prompts, whose offload takes the least work off that queue. Sixty seconds, not
  ten: over ten a few long prompts more or less move the cut, and short prompts take the link in the gaps;
- *how much*: a token bucket of bytes filled at ``link_share`` × the estimate, holding at most ``WINDOW_S`` of it,
  debited by every byte routed over the link (``send``). A request goes while the bucket is not in debt, whatever
  debt its own bytes leave, repaid before the next goes: the KV rate averages at most ``link_share`` of the link.
  A check that a request's own bytes fit would refuse the longest blobs, the ones that save most per byte, at every
  peak, and keep the link well under its limit on average.

Owned by the router's event loop (no locks).

``TCP_INFO`` (``feed_tcp``): each heartbeat carries the sender's figures per peer data address
(``InstanceInfo.tcp_peers``); the router knows which registered instance serves each address, so which datacenter it
is in. A decode instance's figures are its pulls from that peer's store (link: peer's datacenter → its own), a
prefill instance's its pushes to that relay (its own → the relay's): in relay mode the WAN hop is prefill's push.
Decode's pulls from the relay stay inside its datacenter and are not a link's. The link's RTT is the latest figure
reported, its retransmissions the sum of each reporter's count.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from prfaas.messages import InstanceInfo
from prfaas.ratelimit import TokenBucket
from prfaas.scheduler.cost import LOCAL, REMOTE, Inputs, LinkView, Verdict, decide, utilisation
from prfaas.scheduler.link import LinkMonitor

WINDOW_S = 10.0  # the utilisation reported, and the most the link's byte bucket saves up
RANK_S = 60.0  # the candidates a request is ranked among
_MAX_OFFERS = 4096  # candidates kept for the ranking (a busier link ranks over the time they cover)
_EWMA = 0.3
_RECOVER = 0.03
_LINK_BOUND_CHUNKS = 4  # exposed longer than this many chunk times: the link, not the prefill, set the pace
_MIN_LINK_BOUND_S = 0.01
_MAX_REPORTERS = 256  # instances whose retransmission counts a link keeps (the ones heard from last)

LinkKey = tuple[str, str]  # (prefill datacenter, decode datacenter)


def link_name(key: LinkKey) -> str:
    """``prefill-dc:decode-dc`` (unlabelled datacenters read ``-``): a metric label and a JSON key."""
    return f"{key[0] or '-'}:{key[1] or '-'}"


class Bandwidth:
    def __init__(self, nominal_bps: float) -> None:
        self.nominal_bps = nominal_bps
        self.estimate_bps = nominal_bps

    def observe(self, kv_bytes: float, gap_s: float, exposed_s: float, chunk_bytes: int) -> None:
        """One finished transfer: its bytes, the seconds the link spent on them (see the module doc) and the part
        of it exposed after the forward pass."""
        if gap_s <= 0 or kv_bytes <= 0:
            return
        bound = max(_MIN_LINK_BOUND_S, _LINK_BOUND_CHUNKS * 8 * chunk_bytes / self.estimate_bps)
        if exposed_s > bound:
            target, weight = min(self.nominal_bps, 8 * kv_bytes / gap_s), _EWMA
        else:
            target, weight = self.nominal_bps, _RECOVER
        self.estimate_bps = (1 - weight) * self.estimate_bps + weight * target


@dataclass
class Link:
    key: LinkKey
    monitor: LinkMonitor
    bandwidth: Bandwidth
    clock: Callable[[], float] = time.monotonic
    share: float = 0.7  # link_share: the part of the estimate KV may use on average
    inflight_bytes: float = 0.0
    sent_bytes: float = 0.0  # every KV byte routed over this link since the router started
    rtt_ms: float = 0.0
    retransmits: int = 0

    def __post_init__(self) -> None:
        self._started: deque[tuple[float, float]] = deque()
        self._offers: deque[tuple[float, float, float]] = deque(maxlen=_MAX_OFFERS)  # (at, s/byte saved, bytes)
        self._bucket = TokenBucket(*self._bucket_size(), clock=self.clock)
        self._last_delivery = float("-inf")
        self._retransmits: OrderedDict[str, int] = OrderedDict()  # reporter → its retransmissions

    def send(self, nbytes: float) -> None:
        """The router routed ``nbytes`` of KV over this link."""
        self.inflight_bytes += nbytes
        self.sent_bytes += nbytes
        self._started.append((self.clock(), nbytes))
        self._bucket.retune(*self._bucket_size())
        self._bucket.spend(nbytes)

    def _bucket_size(self) -> tuple[float, float]:
        rate = self.share * self.bandwidth.estimate_bps / 8
        return rate, rate * WINDOW_S

    def delivered(self, nbytes: float) -> None:
        """Those bytes reached decode (or never will: the request ended)."""
        self.inflight_bytes = max(0.0, self.inflight_bytes - nbytes)

    def transfer_done(self, kv_bytes: float, exposed_s: float, chunk_bytes: int, at: float | None = None,
                      prefill_s: float = 0.0) -> None:
        """A transfer over this link ended (now, or ``at``) with ``exposed_s`` exposed after a forward pass of
        ``prefill_s``, which it streamed beside: feed the estimate (see the module doc)."""
        now = self.clock() if at is None else at
        since = max(self._last_delivery, now - exposed_s - prefill_s)
        self._last_delivery = max(self._last_delivery, now)
        self.bandwidth.observe(kv_bytes, now - since, exposed_s, chunk_bytes)

    def started_bytes(self) -> float:
        horizon = self.clock() - WINDOW_S
        while self._started and self._started[0][0] < horizon:
            self._started.popleft()
        return sum(n for _, n in self._started)

    def utilisation(self) -> float:
        """The share of the estimated bandwidth the last window's KV bytes take."""
        return utilisation(self.started_bytes(), WINDOW_S, self.bandwidth.estimate_bps)

    def decide(self, inputs: Inputs, chunk_bytes: int, record: bool = True) -> Verdict:
        """The cost model's verdict over this link, subject to its budget (see the module doc). A remote candidate
        joins the budget's ranking unless ``record`` is off (a variant the caller may not take)."""
        verdict = decide(inputs, self.view(chunk_bytes))
        if verdict.route != REMOTE:
            return verdict
        gain = inputs.local_prefill_s / max(inputs.kv_bytes, 1.0)
        self._bucket.retune(*self._bucket_size())
        if not self._ranked_in(gain, inputs.kv_bytes, record) or self._bucket.available() < 0:
            return replace(verdict, route=LOCAL, code="link_busy")
        return verdict

    def _ranked_in(self, gain: float, nbytes: float, record: bool) -> bool:
        """Whether a candidate is within the budget when the last ``RANK_S``'s candidates are ranked by gain."""
        now = self.clock()
        while self._offers and self._offers[0][0] < now - RANK_S:
            self._offers.popleft()
        if record:
            self._offers.append((now, gain, nbytes))
        span = now - self._offers[0][0] if len(self._offers) == _MAX_OFFERS else RANK_S
        ahead = sum(n for _, g, n in self._offers if g > gain)
        return ahead + nbytes <= self.share * self.bandwidth.estimate_bps / 8 * span

    def observe_tcp(self, rtt_ms: float, retransmits: int, reporter: str = "") -> None:
        """``TCP_INFO`` figures of the transfers over this link (``prfaas.transfer.stats``): the smoothed RTT, and
        ``reporter``'s retransmissions so far (a count per reporter, summed)."""
        self.rtt_ms = max(0.0, rtt_ms)
        self._retransmits.pop(reporter, None)
        self._retransmits[reporter] = max(0, retransmits)
        while len(self._retransmits) > _MAX_REPORTERS:
            self._retransmits.popitem(last=False)
        self.retransmits = sum(self._retransmits.values())

    def view(self, chunk_bytes: int) -> LinkView:
        return LinkView(self.bandwidth.estimate_bps, self.inflight_bytes, chunk_bytes, self.rtt_ms / 1e3)

    def stats(self) -> dict[str, float | int | bool | str]:
        health = self.monitor.health()
        return {"link": link_name(self.key), "degraded": health.degraded, "reason": health.reason,
                "samples": health.samples, "success_rate": health.success_rate,
                "exposed_p50_ms": health.exposed_p50_ms, "exposed_p99_ms": health.exposed_p99_ms,
                "bandwidth_bps": self.bandwidth.estimate_bps, "inflight_bytes": self.inflight_bytes,
                "sent_bytes": self.sent_bytes,
                "utilisation": self.utilisation(), "rtt_ms": self.rtt_ms, "retransmits": self.retransmits}


class Links:
    """The router's links, created on first use with the same thresholds and provisioned bandwidth."""

    def __init__(self, degrade_p99_ms: float, success_rate_threshold: float, nominal_bps: float,
                 clock: Callable[[], float] = time.monotonic, share: float = 0.7) -> None:
        self.share = share
        self.degrade_p99_ms = degrade_p99_ms
        self.success_rate_threshold = success_rate_threshold
        self.nominal_bps = nominal_bps
        self.clock = clock
        self._links: dict[LinkKey, Link] = {}

    def get(self, prefill_dc: str, decode_dc: str) -> Link:
        key = (prefill_dc, decode_dc)
        link = self._links.get(key)
        if link is None:
            monitor = LinkMonitor(self.degrade_p99_ms, self.success_rate_threshold, clock=self.clock)
            link = self._links[key] = Link(key, monitor, Bandwidth(self.nominal_bps), self.clock, self.share)
        return link

    def all(self) -> list[Link]:
        return list(self._links.values())


def feed_tcp(links: Links, reporter: InstanceInfo, registered: Iterable[InstanceInfo]) -> None:
    """``reporter``'s heartbeat figures onto the links they crossed (see the module doc). Only a hop between the
    prefill and the decode side counts: decode's pulls from a prefill's store, prefill's pushes to a relay (decode's
    pulls from the relay stay inside its datacenter). A figure for an address no registered instance of that role
    serves is dropped: the router cannot tell which link it crossed."""
    peer_role = _WAN_PEER.get(reporter.role)
    datacenters = {info.kv_address: info.datacenter for info in registered
                   if info.kv_address and info.role == peer_role}
    for tcp in reporter.tcp_peers:
        peer_dc = datacenters.get(tcp.peer)
        if peer_dc is None:
            continue
        pulled = reporter.role == "decode"
        key = (peer_dc, reporter.datacenter) if pulled else (reporter.datacenter, peer_dc)
        links.get(*key).observe_tcp(tcp.rtt_ms, tcp.retransmits, reporter.instance_id)


_WAN_PEER = {"decode": "prefill", "prefill": "relay"}  # who a reporter's WAN connections go to
