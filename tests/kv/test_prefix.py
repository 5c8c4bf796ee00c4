"""Prefix block hashes: a chain over full blocks, salted by model and tenant."""

from __future__ import annotations

import dataclasses

import pytest

from prfaas.kv import Fingerprint
from prfaas.kv.prefix import BLOCK_TOKENS, block_hashes, prefix_salt

FP = Fingerprint(model="m", arch="llama", weights="w" * 16, tokenizer="t" * 16, dtype="float32", max_seq_len=8192)
IDS = list(range(100, 100 + 5 * BLOCK_TOKENS + 7))


def test_only_full_blocks_are_hashed_and_the_hash_is_stable() -> None:
    salt = prefix_salt(FP, "acme")
    hashes = block_hashes(IDS, salt)
    assert len(hashes) == 5 and len(set(hashes)) == 5
    assert block_hashes(IDS, salt) == hashes  # deterministic: no per-process hash seed
    assert block_hashes(IDS[:BLOCK_TOKENS - 1], salt) == []
    assert all(0 <= h < 1 << 128 for h in hashes)


def test_a_block_hash_covers_everything_before_it() -> None:
    salt = prefix_salt(FP, "acme")
    hashes = block_hashes(IDS, salt)
    changed = list(IDS)
    changed[2 * BLOCK_TOKENS + 3] += 1  # one token of the third block
    other = block_hashes(changed, salt)
    assert other[:2] == hashes[:2]
    assert all(a != b for a, b in zip(other[2:], hashes[2:], strict=True))
    # a block of the same tokens after a different history is a different block
    assert block_hashes(IDS[BLOCK_TOKENS:], salt)[0] != hashes[1]
    # prefixes share the chain
    assert block_hashes(IDS[:3 * BLOCK_TOKENS], salt) == hashes[:3]


def test_the_salt_separates_tenants_and_models_but_not_format_versions() -> None:
    ours = block_hashes(IDS, prefix_salt(FP, "acme"))
    assert not set(ours) & set(block_hashes(IDS, prefix_salt(FP, "globex")))
    assert not set(ours) & set(block_hashes(IDS, prefix_salt(FP, "")))
    assert not set(ours) & set(block_hashes(IDS, prefix_salt(dataclasses.replace(FP, weights="x" * 16), "acme")))
    same_model = dataclasses.replace(FP, model="renamed", format_version=FP.format_version + 1)
    assert block_hashes(IDS, prefix_salt(same_model, "acme")) == ours
    assert prefix_salt(FP, None) == prefix_salt(FP, "")


def test_block_size_is_checked() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        block_hashes(IDS, 0, block_tokens=0)
    assert len(block_hashes(IDS, 0, block_tokens=1)) == len(IDS)
