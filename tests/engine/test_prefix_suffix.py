"""Only the missing KV: a decode instance's restore of a transferred blob fills its prefix cache, and a suffix-only
blob (the positions after a prefix the decode instance holds, plus the fixed-size states whole) restored on top of
that cached prefix decodes the same greedy tokens as a monolithic run: every built-in layout (dense, Gated
DeltaNet, Mamba2, short convolution, MLA + KDA, MiniMax, sliding window)."""

from __future__ import annotations

from typing import Any

import pytest

from prfaas.engine.prefix_prefill import PrefixPrefill
from prfaas.errors import KVBadFormat, KVPrefixMissing
from prfaas.kv import KVState, LayerState
from prfaas.kv.format import BlobWriter, decode_state, encode_state
from prfaas.kv.prefix import BLOCK_TOKENS, block_hashes, chain_hex, prefix_salt
from prfaas.kv.state import ATTENTION_KINDS, PrefixRef
from prfaas.kv.suffix import cut
from tests.conftest import random_prompt
from tests.engine.test_prefix_cache import NEW_TOKENS, assert_exact, run

MB = 1024 * 1024
TENANT = "acme"


def shipped(engine: Any, ids: list[int], prefix_tokens: int = 0) -> KVState:
    """What a prefill instance sends for ``ids``: each layer as its hook sees it, cut after ``prefix_tokens``
    (0: whole), through the blob format."""
    layers: list[LayerState] = []

    def on_layer(state: LayerState) -> None:
        layers.append(_copy(cut(state, prefix_tokens, len(ids)) if prefix_tokens else state))

    *_, last = engine.prefill_chunks(ids, 64, on_layer=on_layer)
    assert last is not None
    ref = None
    if prefix_tokens:
        keys = block_hashes(ids, prefix_salt(engine.fingerprint, TENANT))
        ref = PrefixRef(chain_hex(keys[prefix_tokens // BLOCK_TOKENS - 1]), prefix_tokens)
    state = KVState(fingerprint=engine.fingerprint, seq_len=len(ids), layers=layers, cache=engine.cache_class,
                    first_token=last[1], prefix=ref)
    return decode_state(encode_state(state))


def restored_tokens(decode: PrefixPrefill, ids: list[int], kv: KVState) -> list[int]:
    """What decode streams from ``kv`` (joined to its cached prefix when it is a suffix) and stores after it."""
    whole = decode.extend(ids, TENANT, kv) if kv.prefix is not None else kv
    cache = decode.engine.restore(whole)
    decode.keep(ids, TENANT, whole)
    assert whole.first_token is not None
    return [whole.first_token, *decode.engine.stream(cache, whole.first_token, len(ids), NEW_TOKENS - 1)]


@pytest.mark.parametrize(("name", "length", "reused"), [("tiny-llama", 150, 144), ("tiny-bamba", 144, 144),
                                                        ("tiny-bamba", 150, 0), ("tiny-gemma3", 150, 0)])
def test_a_restored_blob_fills_the_decode_cache(engines, name: str, length: int, reused: int) -> None:
    """A local prefill of the next turn then reuses the restored prompt's blocks (a Mamba2 hybrid only where the
    prompt ended on a block boundary: its fixed states are exact only there; a sliding layer of window 64 held
    only the 63 positions before 150, too few for a boundary below it), with the same greedy tokens."""
    engine = engines(name)
    decode = PrefixPrefill(engine, 64 * MB, "test")
    first = random_prompt(length, seed=31)
    assert_exact(engine, first, restored_tokens(decode, first, shipped(engine, first)))
    turn = first + random_prompt(40, seed=32)
    tokens, saved = run(decode, turn, tenant=TENANT)
    assert saved == reused
    assert_exact(engine, turn, tokens)
    assert run(decode, turn, tenant="other")[1] == 0  # stored under the request's tenant only


@pytest.mark.parametrize(("name", "added"), [("tiny-llama", 70), ("tiny-qwen3-next", 70), ("tiny-bamba", 70),
                                             ("tiny-lfm2", 70), ("tiny-kimi-linear", 70), ("tiny-minimax", 70),
                                             ("tiny-gemma3", 20), ("tiny-gemma3", 90)])
def test_a_suffix_blob_on_the_cached_prefix_is_exact(engines, name: str, added: int) -> None:
    """Turn 1 ships whole and fills decode's cache; turn 2 ships only what follows turn 1's last full block
    (tiny-gemma3's window of 64: a short suffix needs the cached pages inside the window, a long one none)."""
    engine = engines(name)
    decode = PrefixPrefill(engine, 64 * MB, "test")
    first = random_prompt(150, seed=33)
    restored_tokens(decode, first, shipped(engine, first))
    turn = first + random_prompt(added, seed=34)
    whole, suffix = shipped(engine, turn), shipped(engine, turn, 144)
    assert suffix.prefix == PrefixRef(suffix.prefix.chain_hash if suffix.prefix else "", 144)
    assert len(encode_state(suffix)) < len(encode_state(whole))
    assert _states(whole) == _states(suffix)  # the fixed-size states travel whole
    assert_exact(engine, turn, restored_tokens(decode, turn, suffix))


def test_a_suffix_blob_whose_prefix_is_gone_is_refused(engines) -> None:
    engine = engines("tiny-llama")
    first = random_prompt(150, seed=35)
    turn = first + random_prompt(30, seed=36)
    suffix = shipped(engine, turn, 144)
    empty = PrefixPrefill(engine, 64 * MB, "test")
    with pytest.raises(KVPrefixMissing, match="no longer cached"):
        empty.extend(turn, TENANT, suffix)
    holder = PrefixPrefill(engine, 64 * MB, "test")
    restored_tokens(holder, first, shipped(engine, first))
    with pytest.raises(KVPrefixMissing, match="not this prompt's"):
        holder.extend(turn, "other", suffix)  # another tenant's chain: never another tenant's pages


def test_a_suffix_blob_needs_format_version_2(engines) -> None:
    engine = engines("tiny-llama")
    turn = random_prompt(60, seed=37)
    suffix = shipped(engine, turn, 48)
    with pytest.raises(KVBadFormat, match="version 2"):
        BlobWriter(BlobWriter.for_state(suffix).header, 1)
    assert decode_state(encode_state(suffix)).prefix == suffix.prefix


def _states(kv: KVState) -> int:
    return sum(layer.nbytes for layer in kv.layers if layer.kind not in ATTENTION_KINDS)


def _copy(state: LayerState) -> LayerState:
    return LayerState(index=state.index, kind=state.kind, grows=state.grows, window=state.window,
                      tensors={n: a.copy() for n, a in state.tensors.items()}, attrs=dict(state.attrs))
