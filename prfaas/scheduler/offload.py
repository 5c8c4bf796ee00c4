"""Where the cost model's inputs come from (``prfaas.scheduler.cost``), gathered for one request.

- **queue waits**: the prefill seconds this router has sent an instance and not yet seen finished (its own
  backlog: complete for a decode instance, which serves one cluster's router), and, for a prefill instance of a
  pool that several routers share, its heartbeat's queue depth × this length's prefill time, whichever is larger;
- **prefill times**: ``PrefillSpeed`` per prefill instance, and one per decode pool (its instances run one model in
  one dtype, and all their prefills outvote one instance's stall) — the speed profile of its side
  (``prefill_profile``, ``local_profile``) refined by the prefills completed (remote: the prefill's ``done``;
  local: decode's first-token stages);
- **KV bytes**: the decode instance's heartbeat layout (``kv_bytes(tokens)``) × the codec's size ratio from the
  remote profile's ``kv`` rows (1 where the profile has none for the codec: no saving assumed);
- **restore**: seconds per KV byte, learnt from decode's first-token ``restore_ms``;
- **link**: bandwidth estimate, bytes in flight and RTT from ``prfaas.scheduler.links``.

A routed request holds a ``Ticket`` (its backlog seconds and its KV bytes in flight) until its first token; the
ticket's ``close`` is idempotent, so every path that ends the request may call it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from prfaas.errors import InvalidRequest, PrfaasError
from prfaas.kv import Fingerprint
from prfaas.messages import InstanceInfo
from prfaas.scheduler.cost import Inputs
from prfaas.scheduler.links import Link
from prfaas.scheduler.speed import PrefillSpeed

_EWMA = 0.2


class Backlog:
    """Prefill seconds sent to each instance and not yet finished."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    def add(self, instance_id: str, seconds: float) -> None:
        self._seconds[instance_id] = max(0.0, self._seconds.get(instance_id, 0.0) + seconds)

    def seconds(self, instance_id: str) -> float:
        return self._seconds.get(instance_id, 0.0)


@dataclass
class Ticket:
    """What one routed request holds: backlog seconds on the instance that prefills it, KV bytes on its link."""

    backlog: Backlog
    instance_id: str
    seconds: float
    link: Link | None = None
    kv_bytes: float = 0.0
    closed: bool = field(default=False)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.backlog.add(self.instance_id, -self.seconds)
        if self.link is not None:
            self.link.delivered(self.kv_bytes)


class Estimator:
    def __init__(self, remote_profile: PrefillSpeed | None = None, local_profile: PrefillSpeed | None = None,
                 codec_ratios: dict[str, float] | None = None) -> None:
        self.remote_profile = remote_profile or PrefillSpeed()
        self.local_profile = local_profile or PrefillSpeed()
        self.codec_ratios = codec_ratios or {}
        self.remote_speeds: dict[str, PrefillSpeed] = {}
        self.local_speeds: dict[str, PrefillSpeed] = {}
        self.backlog = Backlog()
        self.restore_s_per_byte = 0.0

    def remote_speed(self, instance_id: str) -> PrefillSpeed:
        return self.remote_speeds.setdefault(instance_id, self.remote_profile.fresh())

    def local_speed(self, decode: InstanceInfo) -> PrefillSpeed:
        """The prefill speed of ``decode``'s pool (keyed by its fingerprint's pool key)."""
        return self.local_speeds.setdefault(_pool_key(decode), self.local_profile.fresh())

    def kv_bytes(self, tokens: int, decode: InstanceInfo, codec: str, decode_held: int = 0) -> float:
        """The blob's bytes in ``codec``; a suffix-only blob (docs/prefix-cache.md) leaves out the positions of the
        ``decode_held`` tokens the decode instance holds, the fixed-size state travelling whole."""
        whole = decode.kv_bytes(tokens) - decode.kv_bytes_per_token * min(decode_held, tokens)
        return whole * self.codec_ratios.get(codec or "none", 1.0)

    def inputs(self, tokens: int, kv_bytes: float, prefill: InstanceInfo, decode: InstanceInfo,
               held: tuple[int, int] = (0, 0)) -> Inputs:
        """The cost model's inputs; ``held`` = the prompt's tokens cached on (prefill, decode): each route's
        prefill is timed on the rest only (the queue ahead still counts whole prompts)."""
        remote = self.remote_speed(prefill.instance_id)
        remote_queue = max(self.backlog.seconds(prefill.instance_id), prefill.queue_depth * remote.seconds(tokens))
        return Inputs(kv_bytes=kv_bytes, remote_queue_s=remote_queue, remote_prefill_s=remote.seconds(tokens - held[0]),
                      restore_s=self.restore_s_per_byte * kv_bytes,
                      local_queue_s=self.backlog.seconds(decode.instance_id),
                      local_prefill_s=self.local_speed(decode).seconds(tokens - held[1]))

    def ticket(self, instance: InstanceInfo, tokens: int, link: Link | None = None, kv_bytes: float = 0.0) -> Ticket:
        """Count a routed request in the backlog of the instance that prefills it (and its KV on ``link``) until
        ``Ticket.close``."""
        instance_id = instance.instance_id
        speed = self.remote_speed(instance_id) if instance.role == "prefill" else self.local_speed(instance)
        seconds = speed.seconds(tokens)
        self.backlog.add(instance_id, seconds)
        if link is not None:
            link.send(kv_bytes)
        return Ticket(self.backlog, instance_id, seconds, link, kv_bytes)

    def observe_restore(self, kv_bytes: int, seconds: float) -> None:
        if kv_bytes > 0 and seconds >= 0:
            rate = seconds / kv_bytes
            self.restore_s_per_byte = (1 - _EWMA) * self.restore_s_per_byte + _EWMA * rate


def _pool_key(info: InstanceInfo) -> str:
    try:
        return Fingerprint.from_wire(info.fingerprint).pool_key()
    except PrfaasError:  # no whole fingerprint: a pool of its own
        return f"instance:{info.instance_id}"


def codec_ratios(kv_rows: list[tuple[int, str, int]]) -> dict[str, float]:
    """Each codec's blob size over ``none``'s, at the longest length a profile measured both."""
    plain = {n: b for n, c, b in kv_rows if c == "none" and b > 0}
    out: dict[str, float] = {}
    for n, codec, nbytes in sorted(kv_rows):
        if codec != "none" and n in plain:
            out[codec] = nbytes / plain[n]
    return out


def load_profile(path: str) -> tuple[PrefillSpeed, dict[str, float]]:
    """A speed profile's prefill speed and codec size ratios; ``InvalidRequest`` when it cannot be read."""
    try:
        data = json.loads(Path(path).read_text())
        rows = [(int(r["seq_len"]), str(r.get("codec", "none")), int(r["bytes"])) for r in data.get("kv", [])]
        return PrefillSpeed.from_profile(path), codec_ratios(rows)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidRequest(f"cannot read speed profile {path}: {exc}") from exc
