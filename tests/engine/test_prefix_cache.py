"""The engine's prefix cache: a prompt computes only what the cache lacks, and greedy tokens with a hit (full or
partial) equal a monolithic run's, for every built-in layout; the KV shipped after a hit is the whole prompt's;
fixed-state layers reuse only an exact checkpoint; eviction keeps the budget; tenants never share."""

from __future__ import annotations

from typing import Any

import pytest

from prfaas.engine import BUILTIN_MODELS
from prfaas.engine.prefix_cache import PrefixCache
from prfaas.engine.prefix_prefill import PrefixPrefill
from prfaas.kv import KVState, LayerState
from prfaas.kv.prefix import BLOCK_TOKENS, block_hashes, prefix_salt
from tests.conftest import random_prompt
from tests.exactness import first_divergence_is_a_near_tie

NEW_TOKENS = 8
CHUNK = 64  # prefill chunks, so a resumed prefill crosses chunk boundaries too
MB = 1024 * 1024


def run(prefix: PrefixPrefill, ids: list[int], tenant: str = "acme",
        on_layer: Any = None) -> tuple[list[int], int]:
    """Greedy tokens of a prefill through the cache and the decode after it, and the prompt tokens reused."""
    before = prefix.cache.stats.saved_tokens
    *_, last = prefix.chunks(ids, tenant, CHUNK, on_layer=on_layer)
    assert last is not None
    cache, first, _ = last
    tokens = [first, *prefix.engine.stream(cache, first, len(ids), NEW_TOKENS - 1)]
    return tokens, prefix.cache.stats.saved_tokens - before


def assert_exact(engine: Any, ids: list[int], tokens: list[int]) -> None:
    reference = engine.generate(ids, NEW_TOKENS)[:len(tokens)]
    if tokens != reference:  # CONTRACTS: only at a near-tie of the monolithic run
        assert first_divergence_is_a_near_tie(engine, ids, tokens, reference), (tokens, reference)


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_hits_full_and_partial_are_exact_and_ship_the_whole_prompt(engines, name: str) -> None:
    engine = engines(name)
    prefix = PrefixPrefill(engine, 64 * MB, "test")
    first = random_prompt(150, seed=3)  # past the sliding window (64) of tiny-gemma3
    turn = first + random_prompt(70, seed=4)  # the next turn of a chat: the first prompt and more
    tokens, saved = run(prefix, first)
    assert saved == 0
    assert_exact(engine, first, tokens)
    shipped: list[LayerState] = []
    tokens, saved = run(prefix, turn, on_layer=lambda state: shipped.append(_copy(state)))  # partial: up to the
    # first prompt's last block boundary
    assert saved == (len(first) - 1) // BLOCK_TOKENS * BLOCK_TOKENS == 144
    assert_exact(engine, turn, tokens)
    kv = KVState(fingerprint=engine.fingerprint, seq_len=len(turn), layers=shipped, cache=engine.cache_class)
    assert [tokens[0], *engine.decode(kv, tokens[0], NEW_TOKENS - 1)] == tokens  # what a prefill instance ships
    tokens, saved = run(prefix, turn)  # full: all but the last partial block
    assert saved == 208
    assert_exact(engine, turn, tokens)
    assert prefix.cache.nbytes <= 64 * MB


@pytest.mark.parametrize(("name", "reused"), [("tiny-llama", 96), ("tiny-bamba", 0), ("tiny-gemma3", 0)])
def test_a_diverging_prompt_reuses_pages_but_only_an_exact_checkpoint(engines, name: str, reused: int) -> None:
    """Both prompts share 100 tokens: blocks up to 96 are held, but the first prompt stored its fixed states
    (Mamba2) only at 144, and a sliding layer's pages only for its window before 144."""
    engine = engines(name)
    prefix = PrefixPrefill(engine, 64 * MB, "test")
    first = random_prompt(150, seed=5)
    other = first[:100] + random_prompt(60, seed=6)
    run(prefix, first)
    tokens, saved = run(prefix, other)
    assert saved == reused
    assert_exact(engine, other, tokens)
    assert run(prefix, other)[1] == 144  # the second prompt stored its own checkpoint


def test_tenants_never_share_a_prefix(engines) -> None:
    engine = engines("tiny-llama")
    prefix = PrefixPrefill(engine, 64 * MB, "test")
    ids = random_prompt(120, seed=8)
    assert run(prefix, ids, tenant="acme")[1] == 0
    tokens, saved = run(prefix, ids, tenant="globex")
    assert saved == 0  # the same prompt, another tenant: no hit
    assert_exact(engine, ids, tokens)
    assert run(prefix, ids, tenant="")[1] == 0
    assert run(prefix, ids, tenant="acme")[1] == 112


def test_eviction_keeps_the_budget_and_drops_the_least_recently_used(engines) -> None:
    engine = engines("tiny-llama")
    block_bytes = engine.kv_footprint[1] * BLOCK_TOKENS
    prefix = PrefixPrefill(engine, 10 * block_bytes, "test")  # room for 10 blocks
    a, b = random_prompt(100, seed=9), random_prompt(100, seed=10)  # 6 blocks each
    run(prefix, a)
    assert len(prefix.cache) == 6 and prefix.cache.nbytes == 6 * block_bytes
    run(prefix, b)
    assert prefix.cache.nbytes <= 10 * block_bytes and prefix.cache.stats.evictions == 2
    tokens, saved = run(prefix, b)
    assert saved == 96  # the most recent prompt kept all its blocks
    assert_exact(engine, b, tokens)
    assert run(prefix, a)[1] == 4 * BLOCK_TOKENS  # a lost its last two blocks (leaves go first)
    assert prefix.cache.nbytes <= 10 * block_bytes


def test_pinned_blocks_are_not_evicted() -> None:
    page = {"keys": _zeros(4), "values": _zeros(4)}
    cache = PrefixCache(budget_bytes=3 * 2 * page["keys"].nbytes, block_tokens=4)
    salt = prefix_salt(_fingerprint(), "acme")
    first, second = list(range(3, 15)), list(range(20, 32))
    held = cache.lookup(block_hashes(first, salt, 4), 13)
    cache.store(held, _kv(12))
    other = cache.lookup(block_hashes(second, salt, 4), 13)
    cache.store(other, _kv(12))  # the first prompt's blocks are still pinned: nothing fits
    assert len(cache) == 3 and cache.stats.evictions == 0
    cache.release(other)
    cache.release(held)
    again = cache.lookup(block_hashes(second, salt, 4), 13)
    cache.store(again, _kv(12))  # unpinned now: the first prompt's blocks go, leaf first
    cache.release(again)
    assert len(cache) == 3 and cache.stats.evictions == 3
    assert cache.lookup(block_hashes(second, salt, 4), 13).length == 12


def test_no_cache_without_a_budget_or_for_an_engine_without_kv(engines) -> None:
    from prfaas.engine import load_engine

    assert PrefixPrefill.maybe(engines("tiny-llama"), 0, "test") is None
    assert PrefixPrefill.maybe(engines("tiny-llama"), MB, "test") is not None
    assert PrefixPrefill.maybe(load_engine("synthetic-minimax-m2"), MB, "test") is None


def _copy(state: LayerState) -> LayerState:
    """What a prefill instance encodes at once: decode then changes the live cache's states in place."""
    return LayerState(index=state.index, kind=state.kind, grows=state.grows, window=state.window,
                      tensors={n: a.copy() for n, a in state.tensors.items()}, attrs=dict(state.attrs))


def _zeros(positions: int) -> Any:
    import numpy as np

    return np.zeros((1, 2, positions, 4), dtype=np.float32)


def _fingerprint() -> Any:
    from prfaas.kv import Fingerprint

    return Fingerprint(model="m", arch="llama", weights="w", tokenizer="t", dtype="float32", max_seq_len=64)


def _kv(seq_len: int) -> KVState:
    layer = LayerState(index=0, kind="full_attention", grows=True,
                       tensors={"keys": _zeros(seq_len), "values": _zeros(seq_len)}, attrs={"is_initialized": True})
    return KVState(fingerprint=_fingerprint(), seq_len=seq_len, layers=[layer])
