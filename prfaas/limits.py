"""Wire limits: the largest length, count and size any parser accepts from a peer (config key ``limits``).

Every parser checks a length read from the wire against these before it allocates anything:

| key                 | default  | checked by                                         | refused with      |
|---------------------|----------|----------------------------------------------------|-------------------|
| max_message_bytes   | 64 KiB   | data-plane control message (``transfer.protocol``) | ``KV_BAD_FORMAT`` |
| max_meta_bytes      | 1 MiB    | blob header, trailer and layer records             | ``KV_BAD_FORMAT`` |
| max_chunk_bytes     | 64 MiB   | a chunk frame's length, a header's ``chunk_size``  | ``KV_BAD_FORMAT`` |
| max_layers          | 4096     | layers in a blob                                   | ``KV_BAD_FORMAT`` |
| max_tensors         | 64       | tensors in one layer                               | ``KV_BAD_FORMAT`` |
| max_blob_bytes      | 16 GiB   | a blob's payload (``BlobReader``)                  | ``KV_TOO_LARGE``  |
| max_stride          | 64       | a striped Get's stride                             | ``KV_BAD_FORMAT`` |
| max_body_bytes      | 16 MiB   | an HTTP request body (``BodyLimit``)               | HTTP 413          |
| max_header_bytes    | 16 KiB   | an HTTP request head buffered incomplete (h11)     | HTTP 400          |
| max_json_depth      | 64       | nesting of an HTTP request's JSON (``jsonbody``)   | HTTP 400          |
| header_timeout_ms   | 10 s     | an HTTP request head: connect (or its first byte) to its end | HTTP 408, closed |
| body_timeout_ms     | 30 s     | an HTTP request body: its head's end to its own end | HTTP 408, closed |

The defaults are the constants prfaas used before they became configurable (``max_header_bytes`` is h11's own
default; ``max_body_bytes`` is new: an HTTP body had no limit; the two HTTP timeouts are new: a peer that trickled a
head or a body byte by byte held its connection open for ever). There is no process-wide setting: a role passes
its ``config.limits`` to what parses for it (``BlobReader(limits=…)``, ``BlobStore(limits=…)``, which its
``TransferServer`` applies too, ``prfaas.security.guards.limit_requests`` for its HTTP app); a parser given none
applies ``DEFAULT``. A bad value is refused when the config is built (``InvalidRequest`` naming the key).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from prfaas.errors import InvalidRequest

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
MIN_CHUNK = 4 * KIB  # the blob format's smallest chunk size


@dataclass(frozen=True)
class WireLimits:
    max_message_bytes: int = 64 * KIB
    max_meta_bytes: int = 1 * MIB
    max_chunk_bytes: int = 64 * MIB
    max_layers: int = 4096
    max_tensors: int = 64
    max_blob_bytes: int = 16 * GIB
    max_stride: int = 64
    max_body_bytes: int = 16 * MIB
    max_header_bytes: int = 16 * KIB
    max_json_depth: int = 64
    header_timeout_ms: int = 10_000
    body_timeout_ms: int = 30_000

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequest(f"config: limits.{f.name} must be a positive integer, not {value!r}")
        checks = [
            (self.max_message_bytes >= 1 * KIB, "limits.max_message_bytes must be at least 1024"),
            (self.max_meta_bytes >= 4 * KIB, "limits.max_meta_bytes must be at least 4096"),
            (MIN_CHUNK <= self.max_chunk_bytes <= 1 * GIB, "limits.max_chunk_bytes must be within 4 KiB–1 GiB"),
            (self.max_blob_bytes >= self.max_chunk_bytes, "limits.max_blob_bytes must be ≥ limits.max_chunk_bytes"),
            (self.max_stride <= 1024, "limits.max_stride must be within 1–1024"),
            (self.max_body_bytes >= 1 * KIB, "limits.max_body_bytes must be at least 1024"),
            (self.max_header_bytes >= 1 * KIB, "limits.max_header_bytes must be at least 1024"),
            (4 <= self.max_json_depth <= 512, "limits.max_json_depth must be within 4–512"),
            (self.header_timeout_ms >= 100, "limits.header_timeout_ms must be at least 100"),
            (self.body_timeout_ms >= 100, "limits.body_timeout_ms must be at least 100"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(f"config: {message}")


DEFAULT = WireLimits()  # frozen: what a parser applies when its caller passes no limits
