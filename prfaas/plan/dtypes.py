"""Element sizes of KV dtypes and codecs, in bits (int4 is half a byte)."""

from __future__ import annotations

from prfaas.errors import InvalidRequest

_BITS = {
    "float32": 32, "fp32": 32, "float": 32,
    "bfloat16": 16, "bf16": 16, "float16": 16, "fp16": 16, "half": 16,
    "float8": 8, "fp8": 8, "float8_e4m3fn": 8, "float8_e5m2": 8, "int8": 8,
    "int4": 4,
}


def dtype_bits(name: str) -> int:
    """Bits per element of ``name`` (``bfloat16``, ``fp8``, ``int4``, ``torch.float32`` …)."""
    key = str(name).lower().removeprefix("torch.")
    if key not in _BITS:
        known = ", ".join(sorted(_BITS))
        raise InvalidRequest(f"unknown dtype {name!r}: expected one of {known}")
    return _BITS[key]


def nbytes(elements: int, bits: int) -> int:
    """Bytes for ``elements`` values of ``bits`` bits each, rounded up to a whole byte."""
    return (elements * bits + 7) // 8
