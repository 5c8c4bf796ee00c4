"""``ConnectorSettings``: the connector's part of vLLM's ``kv_connector_extra_config``, validated once.

Keys (all optional)::

    kv_address        "host:port"  direct mode: where this producer's data-plane server listens (its own store);
                                   sent to the consumer in the request's kv_transfer_params
    relay             "host:port"  relay mode: the prfaas relay store this producer pushes each blob into
    relays            ["host:port"] relays a request may name instead (kv_transfer_params "relay"); no other
                                   address is ever pushed to, so a request cannot send KV anywhere it likes
    relay_from_request false       push to whatever relay a request names: only for a vLLM server that nobody
                                   but its prfaas instance reaches (``prfaas serve prefill --engine vllm``, where
                                   the router names the relay per request, as ``push_to``)
    info_file         path         where the connector writes, at start-up, what its prfaas instance advertises:
                                   ``{"fingerprint", "kv_bytes_per_token", "kv_budget_bytes"}`` (JSON)
    tcp_file          path         where the connector writes, after each pull and push, its connections'
                                   ``TCP_INFO`` per peer data address (``[{peer, rtt_ms, retransmits}]``, JSON,
                                   at most ``MAX_TCP_PEERS``), replaced whole: its prfaas instance's heartbeat
                                   carries them (``InstanceInfo.tcp_peers``)
    codec             "none"       prfaas KV codec (``prfaas.kv.codecs``); "none" is byte-exact
    overlap           "auto"       when a producer encodes and sends each saved layer: "layers", at once, while
                                   later layers compute (the forward pass runs on an accelerator); "step", after
                                   the step's forward pass (on CPU, where the encoder thread would take cores and
                                   the GIL from vLLM's OpenMP threads; a step longer than half of
                                   ``kv_transfer_timeout_s`` sends its layers from then on); "auto": "step"
                                   where the KV cache is in host memory, else "layers"
    chunk_kb          1024         blob chunk size
    store_budget_mb   1024         direct mode: the producer's store budget
    kv_ttl_s          60           direct mode: how long an unreleased blob is kept (a relay applies its own)
    kv_transfer_timeout_s 2        one network wait (connect, one reply, one chunk: 1 MiB is 8 ms at 1 Gbit/s); a
                                   stalled attempt is resumed from the last verified chunk after it
    kv_deadline_s     30           a whole pull (and push), past which the load fails and vLLM recomputes
    creation_grace_s  5            how long a consumer retries KV_NOT_FOUND (the producer may not have started)
    retries           3            resumed pulls after a reset, a stall or a corrupt chunk
    tls               {ca, cert, key, required}   TLS 1.3 on the data plane, as prfaas's ``tls`` config

A producer needs ``kv_address`` or ``relay`` (a relay wins when both are given; a request that names one of
``relays`` goes there). Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from prfaas.config import TLSConfig
from prfaas.errors import InvalidRequest
from prfaas.kv import codecs

OVERLAPS = ("auto", "layers", "step")


@dataclass(frozen=True)
class ConnectorSettings:
    kv_address: str | None = None
    relay: str | None = None
    relays: tuple[str, ...] = ()
    relay_from_request: bool = False
    info_file: str | None = None
    tcp_file: str | None = None
    codec: str = "none"
    overlap: str = "auto"
    chunk_kb: int = 1024
    store_budget_mb: int = 1024
    kv_ttl_s: float = 60.0
    kv_transfer_timeout_s: float = 2.0
    kv_deadline_s: float = 30.0
    creation_grace_s: float = 5.0
    retries: int = 3
    tls: TLSConfig = field(default_factory=TLSConfig)

    def __post_init__(self) -> None:
        codecs.check_codec(self.codec)
        if self.overlap not in OVERLAPS:
            raise InvalidRequest(f"kv_connector_extra_config overlap must be one of {list(OVERLAPS)}")
        for name in ("chunk_kb", "store_budget_mb", "kv_ttl_s", "kv_transfer_timeout_s", "kv_deadline_s"):
            if getattr(self, name) <= 0:
                raise InvalidRequest(f"kv_connector_extra_config {name} must be positive")
        if not isinstance(self.relay_from_request, bool):
            raise InvalidRequest("kv_connector_extra_config relay_from_request must be true or false")
        if self.retries < 0 or self.creation_grace_s < 0:
            raise InvalidRequest("kv_connector_extra_config retries and creation_grace_s must be >= 0")
        for address in (self.kv_address, self.relay, *self.relays):
            if address is not None:
                split_address(address)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """From ``kv_connector_extra_config``; ``InvalidRequest`` names an unknown key or a bad value."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidRequest(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        tls = extra.pop("tls", None) or {}
        if not isinstance(tls, dict):
            raise InvalidRequest("kv_connector_extra_config tls must be a mapping {ca, cert, key, required}")
        extra["relays"] = tuple(extra.get("relays") or ())
        try:
            return cls(**extra, tls=TLSConfig(**tls))
        except TypeError as exc:
            raise InvalidRequest(f"bad kv_connector_extra_config: {exc}") from exc

    def destination(self, requested: str | None) -> str | None:
        """Where a request's blob goes and consumers pull it: the relay it names (one of ``relays``, or any with
        ``relay_from_request``; else ``InvalidRequest``), else ``relay``, else this producer's own server; None:
        nowhere configured."""
        if requested and not self.relay_from_request and requested not in (self.relay, *self.relays):
            raise InvalidRequest(f"relay {requested!r} is not one of this producer's relays")
        if requested:
            split_address(requested)
        return requested or self.relay or self.kv_address

    def pushes_to(self, address: str) -> bool:
        """Whether blobs for ``address`` are pushed (a relay) rather than kept in this producer's store."""
        return address != self.kv_address or self.kv_address is None

    def holds_layers(self, device_type: str) -> bool:
        """Whether saved layers wait for the step's end (``overlap``) with the KV cache on ``device_type``."""
        return self.overlap == "step" or (self.overlap == "auto" and device_type == "cpu")

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_kb * 1024


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port``; ``InvalidRequest`` otherwise."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidRequest(f"bad address {address!r}; expected host:port")
    return host, int(port)
