"""Properties of every published config: monotone in length, windows cap, hybrids' fixed part constant."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.plan import KVPlan, plan_from_path

PLANS: list[KVPlan] = [plan_from_path(p) for p in sorted((Path(__file__).parent / "fixtures").glob("*.json"))]
lengths = st.integers(min_value=0, max_value=1 << 20)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(PLANS), lengths, lengths)
def test_monotone_in_length(p: KVPlan, a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert p.kv_bytes(lo) <= p.kv_bytes(hi)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(PLANS), lengths)
def test_windows_cap(p: KVPlan, n: int) -> None:
    for layer in p.layers:
        if layer.cap is not None:
            assert layer.bytes_at(n) <= layer.bytes_at(layer.cap) == layer.bytes_at(layer.cap + n)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(PLANS), lengths)
def test_fixed_part_independent_of_length(p: KVPlan, n: int) -> None:
    growing = sum(layer.bytes_at(n) - layer.fixed_bytes for layer in p.layers)
    assert p.kv_bytes(n) == p.fixed_bytes + growing
    assert p.kv_bytes(0) == p.fixed_bytes
    for layer in p.layers:
        if layer.elements_per_token == 0:
            assert layer.bytes_at(n) == layer.fixed_bytes


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(PLANS), st.integers(min_value=1 << 17, max_value=1 << 22))
def test_long_prompts_are_affine(p: KVPlan, n: int) -> None:
    """Once every window is full, bytes = fixed + windows + bytes_per_token × n."""
    assert p.kv_bytes(n) == p.fixed_bytes + p.window_bytes + p.bytes_per_token * n
