from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.errors import InvalidRequest
from prfaas.kv import codecs

shapes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 70), st.sampled_from([8, 16, 33, 64]))


def round_trip(array: np.ndarray, codec: str, role: str) -> tuple[np.ndarray, int]:
    enc = codecs.encode("t", array, codec, role)
    wire = [np.frombuffer(p.tobytes(), dtype=dt).reshape(shape)
            for p, (dt, shape) in zip(enc.parts, codecs.part_layout(enc.desc), strict=True)]
    return codecs.decode(enc.desc, wire), enc.nbytes


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31), scale=st.sampled_from([1e-3, 1.0, 50.0]),
       role=st.sampled_from(["key", "value"]))
def test_lossy_codecs_keep_their_promise(shape: tuple[int, ...], seed: int, scale: float, role: str) -> None:
    x = (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)
    amax, span = float(np.abs(x).max()), float(x.max() - x.min())
    out, _ = round_trip(x, "bf16", role)
    assert np.all(np.abs(out - x) <= 2**-8 * np.abs(x))
    out, _ = round_trip(x, "fp8", role)
    assert np.abs(out - x).max() <= 2**-4 * amax * 1.01
    for codec, qmax in (("int8", 255), ("int4", 15)):
        out, _ = round_trip(x, codec, role)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert np.abs(out - x).max() <= 0.51 * span / qmax + 2**-10 * amax


def test_none_is_bit_exact_for_every_dtype() -> None:
    rng = np.random.default_rng(1)
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        x = rng.standard_normal((2, 3, 5)).astype(dtype)
        out, n = round_trip(x, "none", "key")
        assert out.tobytes() == x.tobytes() and n == x.nbytes


def test_sizes_shrink_as_promised() -> None:
    x = np.random.default_rng(2).standard_normal((1, 8, 256, 64)).astype(np.float32)
    sizes = {c: round_trip(x, c, "value")[1] for c in codecs.CODECS}
    assert sizes["none"] == x.nbytes
    assert sizes["bf16"] == x.nbytes // 2
    assert sizes["fp8"] == x.nbytes // 4 + x.nbytes // 4 // 32 * 2
    assert sizes["int8"] < sizes["bf16"] and sizes["int4"] < sizes["int8"] * 0.65


def test_keys_are_grouped_per_channel() -> None:
    """An outlier channel in the keys must not wreck the precision of the other channels (KIVI)."""
    x = np.random.default_rng(3).standard_normal((1, 1, 128, 32)).astype(np.float32)
    x[..., 0] *= 100.0
    as_keys, _ = round_trip(x, "int4", "key")
    as_values, _ = round_trip(x, "int4", "value")
    err_keys = np.abs(as_keys - x)[..., 1:].max()
    err_values = np.abs(as_values - x)[..., 1:].max()
    assert err_keys < err_values / 10


def test_states_stay_bf16_under_lossy_codecs() -> None:
    x = np.random.default_rng(4).standard_normal((1, 4, 16, 16)).astype(np.float32)
    for codec in ("fp8", "int8", "int4"):
        enc = codecs.encode("recurrent_states.0", x, codec, "state")
        assert enc.desc["codec"] == "bf16"


def test_unknown_codec_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequest, match="unknown codec 'zip'"):
        codecs.check_codec("zip")
