"""Prefix block hashes: a prompt's token ids cut into fixed blocks, each block named by a chain hash.

``hash(block j) = xxh3_128(hash(block j-1) ‖ token ids of block j)``, so one hash names a block *and* everything
before it (vLLM's scheme): two prompts share block j's hash only when they share every token up to its end. The
chain's root is a salt over the model fingerprint and the tenant, so the same prompt hashes differently under
another model or another tenant: a tenant can neither hit nor probe (by timing, or from a heartbeat summary of
held hashes) another tenant's cached prefixes. Only full blocks are hashed; a trailing partial block has no name.

Ground floor: imports nothing above ``prfaas.kv.fingerprint`` (numpy and xxhash only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

import numpy as np
import xxhash

from prfaas.kv.fingerprint import Fingerprint

BLOCK_TOKENS = 16  # tokens per block (vLLM's default): small enough that a partial hit loses little
_HASH_BYTES = 16


def prefix_salt(fingerprint: Fingerprint, tenant: str | None) -> int:
    """The chain's root: every fingerprint field but the display name and format version (KV made for one model
    is valid for every instance of it), and the tenant ("" for requests without one)."""
    fields = "|".join(f"{k}={v}" for k, v in sorted(asdict(fingerprint).items())
                      if k not in ("model", "format_version"))
    return int(xxhash.xxh3_128_intdigest(f"prfaas-prefix|{fields}|tenant={tenant or ''}".encode()))


def pool_tenant(cluster: str, tenant: str | None) -> str:
    """The tenant a prefill instance salts with: one prefill pool serves several client clusters, whose tenants may
    share a name (each has ``default``), so the cluster (the one the instance's gate proved) qualifies it."""
    return f"{cluster}/{tenant or ''}"


def block_hashes(token_ids: Sequence[int], salt: int, block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """The chain hash of every full block of ``token_ids`` (``len // block_tokens`` of them), in order."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be at least 1")
    full = len(token_ids) // block_tokens
    ids = np.asarray(token_ids[:full * block_tokens], dtype="<u4").reshape(full, block_tokens)
    hashes, parent = [], salt
    for row in ids:
        parent = int(xxhash.xxh3_128_intdigest(parent.to_bytes(_HASH_BYTES, "little") + row.tobytes()))
        hashes.append(parent)
    return hashes


# A heartbeat's summary of held blocks: the most recently used chain hashes, each cut to 64 bits as 16 hex
# digits (a collision only misplaces a request: the engine matches on the full 128 bits). 512 of them are
# 9.5 KiB of compact JSON per heartbeat; a hash stands for its whole chain, so they name up to 512 prompts' prefixes.
SUMMARY_BLOCKS = 512


def chain_hex(chain_hash: int) -> str:
    """A whole chain hash (128 bits) as 32 hex digits: how a suffix-only blob names the prefix it extends."""
    return f"{chain_hash:032x}"


def summary_key(chain_hash: int) -> str:
    """A chain hash as a summary names it."""
    return f"{chain_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def held_tokens(hashes: Sequence[int], held: frozenset[str] | set[str], prompt_len: int,
                block_tokens: int = BLOCK_TOKENS) -> int:
    """Tokens of a prompt (chain ``hashes``, ``prompt_len`` tokens) an instance whose summary is ``held`` can
    reuse: up to the deepest held block (a block is held only with its parent, so its whole chain is), leaving at
    least one token to compute, as ``PrefixCache.lookup`` does. An upper bound: a model with fixed-state layers
    reuses only a block with a checkpoint."""
    deepest = next((j + 1 for j in range(len(hashes) - 1, -1, -1) if summary_key(hashes[j]) in held), 0)
    return min(deepest, (prompt_len - 1) // block_tokens) * block_tokens if prompt_len > 0 else 0
