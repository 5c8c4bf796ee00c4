"""The compatibility fingerprint: both sides of a KV transfer must agree on it, or the transfer is refused."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import xxhash

from prfaas.errors import KVBadFormat, KVIncompatible

FORMAT_VERSION = 2  # 2: a suffix-only blob's header names the cached prefix it extends (prfaas.kv.format)
# Readers accept these blob format versions (current and previous, for rolling upgrades).
SUPPORTED_VERSIONS = frozenset({1, 2})

# the files a vLLM instance's weights and tokenizer digests are taken over (files_digest)
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "chat_template.jinja")

_LENIENT = frozenset({"model", "format_version"})


def readable_by(version: int) -> frozenset[int]:
    """The blob versions a reader whose current version is ``version`` accepts: its own and the previous one."""
    return frozenset({version, version - 1})


def negotiate_version(reader_versions: Iterable[int]) -> int:
    """The newest blob version this writer can write that every reader (given by its current version) accepts;
    rolling upgrades write the old format until the last old reader is gone. ``KVIncompatible`` if none."""
    readers = set(reader_versions) or {FORMAT_VERSION}
    for version in sorted(SUPPORTED_VERSIONS, reverse=True):
        if version <= FORMAT_VERSION and all(version in readable_by(r) for r in readers):
            return version
    raise KVIncompatible(f"no blob format version that readers at versions {sorted(readers)} all accept; "
                         f"this writer writes {sorted(SUPPORTED_VERSIONS)}")


@dataclass(frozen=True)
class Fingerprint:
    """What must match for a KV state made by one engine to be restored by another.

    ``weights`` and ``tokenizer`` are xxHash64 digests; ``dtype`` is the KV dtype the cache holds (the codec is
    per blob and travels in the blob header instead).
    """

    model: str
    arch: str
    weights: str
    tokenizer: str
    dtype: str
    max_seq_len: int
    format_version: int = FORMAT_VERSION

    def short_hash(self) -> str:
        """12 hex digits over every field: the prefix of each ``kv_id``."""
        text = "|".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return xxhash.xxh64_hexdigest(text.encode())[:12]

    def pool_key(self) -> str:
        """12 hex digits over the fields that must match (not the display name nor the format version): instances
        with one pool key can be paired, so a deployment's pools during a model upgrade are keyed by it."""
        text = "|".join(f"{k}={v}" for k, v in sorted(asdict(self).items()) if k not in _LENIENT)
        return xxhash.xxh64_hexdigest(text.encode())[:12]

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> Fingerprint:
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise KVBadFormat(f"fingerprint must have exactly the fields {sorted(names)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise KVBadFormat(f"bad fingerprint: {exc}") from exc

    def mismatches(self, other: Fingerprint) -> list[str]:
        """Names of the fields that differ. The display name is informative only; a format version is
        compatible when this side reads it (current or previous), so rolling upgrades can mix versions."""
        names = [f.name for f in fields(self) if f.name not in _LENIENT]
        bad = [n for n in names if getattr(self, n) != getattr(other, n)]
        if other.format_version not in SUPPORTED_VERSIONS:
            bad.append("format_version")
        return bad

    def check_compatible(self, other: Fingerprint) -> None:
        """Raise ``KVIncompatible`` naming each mismatching field with both values."""
        bad = self.mismatches(other)
        if bad:
            detail = "; ".join(f"{n}: {getattr(self, n)!r} here, {getattr(other, n)!r} in the KV" for n in bad)
            raise KVIncompatible(f"KV state does not match this engine ({detail})")


def files_digest(path: Path, patterns: tuple[str, ...]) -> str:
    """xxHash64 over the names and bytes of ``path``'s files matching ``patterns`` (a model not on disk: its name)."""
    digest = xxhash.xxh64()
    files = sorted({f for p in patterns for f in path.glob(p) if f.is_file()}) if path.is_dir() else []
    if not files:
        digest.update(str(path).encode())
    for file in files:
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


def tokenizer_files_digest(path: Path) -> str:
    """A vLLM instance's ``tokenizer`` digest: its tokenizer directory's files (``TOKENIZER_FILES``)."""
    return files_digest(path, TOKENIZER_FILES)


def tokenizer_hash(tokenizer: Any) -> str:
    """A prfaas engine's ``tokenizer`` digest: the loaded tokenizer's vocabulary and merges, and its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return xxhash.xxh64_hexdigest((text + "|" + str(getattr(tokenizer, "chat_template", ""))).encode())
