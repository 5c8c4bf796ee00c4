"""``RedisBackend``: blob frames on a Redis server, for users who already run Redis as their cache tier.

One Redis hash per blob, ``<prefix><kv_id>``: field ``h`` the header frame, ``c:<i>`` chunk frames, ``t`` the
trailer, ``m:*`` the sizes a restarted store needs to adopt it. The hash gets ``PEXPIRE`` = the store's TTL plus
``TTL_GRACE_MS`` at creation (counted from creation, never refreshed), so Redis deletes it even if the store
process is gone; the store's own TTL ends it first and records why. Frames after the first are added by a Lua
script that refuses to recreate a hash Redis has already dropped (a re-created hash would have no TTL: a leak).

Memory policy: ``configure_policy`` sets ``maxmemory-policy`` (default ``noeviction``: over Redis's own limit a
write fails with ``KV_STORE_FULL`` instead of Redis silently dropping some other blob). A policy that evicts still
cannot give a reader partial data: the hash goes whole, and the store answers ``KV_NOT_FOUND``.

Errors are mapped here: connection trouble and timeouts → ``KVUnavailable``, Redis's OOM → ``KVStoreFull``.
One store owns a prefix: give each store process its own (``prfaas:kv:<instance id>:``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
from collections.abc import Iterator
from typing import Any

import redis

from prfaas.errors import KVStoreFull, KVUnavailable
from prfaas.store.backend import HEADER, TRAILER, BlobMeta

log = logging.getLogger(__name__)
TTL_GRACE_MS = 5000
_PUT_IF_LIVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""
_META = ("m:chunk_size", "m:created_ms", "m:chunks", "m:payload", "m:nbytes", "m:xxh64", "m:ready")


@contextlib.contextmanager
def mapped(what: str) -> Iterator[None]:
    """Redis errors as prfaas errors, in one place."""
    try:
        yield
    except redis.exceptions.ResponseError as exc:
        if str(exc).startswith("OOM") or "> 'maxmemory'" in str(exc):  # plain command / inside a script
            raise KVStoreFull(f"Redis is out of memory during {what}: {exc}") from exc
        raise KVUnavailable(f"Redis refused {what}: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        raise KVUnavailable(f"Redis unavailable during {what}: {exc}") from exc


def _field(slot: int) -> str:
    return "h" if slot == HEADER else "t" if slot == TRAILER else f"c:{slot}"


def _meta_values(meta: BlobMeta) -> dict[str, int]:
    values = (meta.chunk_size, meta.created_ms, meta.chunks, meta.payload, meta.nbytes,
              -1 if meta.payload_xxh64 is None else meta.payload_xxh64, int(meta.ready))
    return dict(zip(_META, values, strict=True))


def _meta_fields(meta: BlobMeta) -> list[str | int]:
    return [x for pair in _meta_values(meta).items() for x in pair]


class RedisBackend:
    name = "redis"
    holds_frames = False  # copies each frame to the server: the caller may reuse its buffer at once

    def __init__(self, url: str, prefix: str, policy: str | None = "noeviction", timeout_s: float = 5.0,
                 ca: str = "") -> None:
        """Connect to ``url`` (``redis://host:port/db``, ``rediss://`` for TLS verified against ``ca`` or the
        system's CAs, ``unix:///path``; ACL credentials as ``redis://user:password@host``, or from
        ``$PRFAAS_REDIS_USERNAME`` / ``$PRFAAS_REDIS_PASSWORD`` so they stay out of config files);
        ``KVUnavailable`` if unreachable or the credentials are refused."""
        self.prefix = prefix
        options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        for name in ("username", "password"):
            if os.environ.get(f"PRFAAS_REDIS_{name.upper()}"):
                options[name] = os.environ[f"PRFAAS_REDIS_{name.upper()}"]
        if url.startswith("rediss://"):
            options.update(ssl_cert_reqs="required", ssl_min_version=ssl.TLSVersion.TLSv1_2,
                           **({"ssl_ca_certs": ca} if ca else {}))
        self.client = redis.Redis.from_url(url, **options)
        with mapped("connect"):
            self.client.ping()
        self._put_if_live = self.client.register_script(_PUT_IF_LIVE)
        self.policy = self.configure_policy(policy) if policy else self._current_policy()

    def configure_policy(self, policy: str) -> str:
        """Set ``maxmemory-policy``; a server that forbids ``CONFIG`` keeps its own (logged, and returned)."""
        try:
            self.client.config_set("maxmemory-policy", policy)
        except redis.exceptions.RedisError as exc:
            log.warning("cannot set Redis maxmemory-policy to %s (%s); keeping the server's", policy, exc)
        return self._current_policy()

    def _current_policy(self) -> str:
        with contextlib.suppress(redis.exceptions.RedisError):
            return str(self.client.config_get("maxmemory-policy").get("maxmemory-policy", "unknown"))
        return "unknown"

    def key(self, kv_id: str) -> str:
        return self.prefix + kv_id

    def start(self, meta: BlobMeta, header: bytes, ttl_s: float) -> None:
        key = self.key(meta.kv_id)
        with mapped(f"create {meta.kv_id}"):
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(key)
            fields: dict[str, bytes | int] = {"h": header, **_meta_values(meta)}
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            pipe.pexpire(key, int(ttl_s * 1000) + TTL_GRACE_MS)
            pipe.execute()

    def put(self, meta: BlobMeta, slot: int, frame: bytes) -> bool:
        with mapped(f"write {meta.kv_id}"):
            return bool(self._put_if_live(keys=[self.key(meta.kv_id)], args=[_field(slot), frame,
                                                                            *_meta_fields(meta)]))

    def get(self, kv_id: str, slot: int) -> bytes | None:
        with mapped(f"read {kv_id}"):
            value = self.client.hget(self.key(kv_id), _field(slot))
        return None if value is None else bytes(value)  # type: ignore[arg-type]

    def drop(self, kv_id: str) -> None:
        with mapped(f"delete {kv_id}"):
            self.client.unlink(self.key(kv_id))

    def leftovers(self) -> list[BlobMeta]:
        found = []
        with mapped("scan for leftovers"):
            for key in self.client.scan_iter(match=self.prefix + "*", count=1000):
                values = self.client.hmget(key, list(_META))
                if None not in values:
                    found.append(_meta(key.decode()[len(self.prefix):], [int(v) for v in values]))  # type: ignore[arg-type]
                else:  # a hash without its sizes is not ours to adopt; it expires by its own TTL
                    log.warning("ignoring Redis key %r without blob sizes", key)
        return found

    def live_keys(self) -> list[str]:
        """Every key under this backend's prefix (leak checks)."""
        with mapped("scan"):
            return [k.decode() for k in self.client.scan_iter(match=self.prefix + "*", count=1000)]

    def close(self) -> None:
        self.client.close()


def _meta(kv_id: str, v: list[int]) -> BlobMeta:
    return BlobMeta(kv_id, chunk_size=v[0], created_ms=v[1], chunks=v[2], payload=v[3], nbytes=v[4],
                    payload_xxh64=None if v[5] < 0 else v[5], ready=bool(v[6]))
