"""KV codecs: how one tensor becomes bytes on the wire and back, vectorised with numpy.

======  ==========================================================  ========================
codec   what it does                                                promise
======  ==========================================================  ========================
none    the tensor's own dtype, byte for byte                       bit-exact
bf16    round to bfloat16 (nearest even)                            |err| ≤ 2^-8·|x|
fp8     float8 e4m3, one float16 scale per group of 32              |err| ≤ 2^-4·amax(group)
int8    asymmetric, group-wise (32), float16 scale and minimum      |err| ≤ ½·scale
int4    as int8 with 4 bits, two values a byte                      |err| ≤ ½·scale
======  ==========================================================  ========================

As in KIVI, keys are grouped along the token axis (per channel: outlier channels stay in their own group) and
values along the channel axis (per token). Fixed-size states (linear attention, SSM, convolution) are small and
feed back into every later step, so the lossy codecs keep them in bfloat16 instead of quantizing further.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from prfaas.errors import InvalidRequest, KVBadFormat

CODECS = ("none", "bf16", "fp8", "int8", "int4")
GROUP = 32
_FP8_MAX = 448.0
_FLOAT16_MAX = 60000.0
_ALLOWED_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "uint8", "int8",
                             "int32", "int64"})
_BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass
class EncodedTensor:
    """One tensor as it travels: a description (msgpack-able) and the arrays whose bytes follow it."""

    desc: dict[str, Any]
    parts: list[np.ndarray] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def dtype_of(name: str) -> np.dtype:
    if name not in _ALLOWED_DTYPES:
        raise KVBadFormat(f"unsupported tensor dtype {name!r}")
    return np.dtype(name)


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise InvalidRequest(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    return codec


def effective_codec(codec: str, role: str, dtype: np.dtype) -> str:
    """The codec a tensor really gets: states stop at bf16; non-float tensors always travel as they are."""
    if codec == "none" or dtype.kind not in "fV" or dtype == np.dtype("float8_e4m3fn"):
        return "none"
    if dtype == _BF16 and codec == "bf16":
        return "none"
    if role == "state":
        return "none" if dtype == _BF16 else "bf16"
    return codec


def encode(name: str, array: np.ndarray, codec: str, role: str) -> EncodedTensor:
    """Encode ``array``; ``role`` is ``key``, ``value`` or ``state`` (decides the grouping axis)."""
    array = np.ascontiguousarray(array)
    codec = effective_codec(codec, role, array.dtype)
    desc: dict[str, Any] = {"name": name, "dtype": array.dtype.name, "shape": list(array.shape), "codec": codec}
    if codec == "none":
        return EncodedTensor(desc, [array])
    if codec == "bf16":
        return EncodedTensor(desc, [array.astype(_BF16)])
    axis = -2 if role == "key" and array.ndim >= 2 else -1
    desc["axis"] = axis
    grouped, _ = _grouped(array, axis)
    if codec == "fp8":
        return _encode_fp8(desc, grouped)
    return _encode_int(desc, grouped, bits=8 if codec == "int8" else 4)


def decode(desc: dict[str, Any], parts: list[np.ndarray]) -> np.ndarray:
    """Inverse of ``encode``; ``parts`` are views of the received bytes with the dtypes of ``part_layout``."""
    dtype = dtype_of(desc["dtype"])
    shape = tuple(desc["shape"])
    codec = desc["codec"]
    if codec == "none":
        return parts[0].reshape(shape)
    if codec == "bf16":
        return parts[0].astype(dtype).reshape(shape)
    axis = int(desc["axis"])
    moved_shape = list(shape)
    moved_shape.append(moved_shape.pop(axis))
    if codec == "fp8":
        values = parts[0].astype(np.float32) * parts[1].astype(np.float32)[..., None]
    else:
        values = _decode_int(parts, bits=8 if codec == "int8" else 4)
    n = moved_shape[-1]
    flat = values.reshape(*moved_shape[:-1], -1)[..., :n]
    return np.moveaxis(flat, -1, axis).astype(dtype)


def part_layout(desc: dict[str, Any]) -> list[tuple[np.dtype, tuple[int, ...]]]:
    """Dtype and shape of each wire part, derived from the description alone (never trusted from the wire)."""
    dtype = dtype_of(str(desc.get("dtype")))
    shape = tuple(int(d) for d in desc.get("shape", ()))
    codec = desc.get("codec")
    if len(shape) > 8 or any(d < 0 for d in shape):
        raise KVBadFormat(f"bad tensor shape {shape}")
    if codec == "none":
        return [(dtype, shape)]
    if codec == "bf16":
        return [(_BF16, shape)]
    axis = int(desc.get("axis", -1))
    if not shape or axis not in (-1, -2) or len(shape) < -axis:
        raise KVBadFormat(f"bad quantization axis {axis} for shape {shape}")
    moved = list(shape)
    moved.append(moved.pop(axis))
    groups = -(-moved[-1] // GROUP)
    lead = (*moved[:-1], groups)
    scale_dtype = np.dtype(str(desc.get("scale_dtype", "float16")))
    if codec == "fp8":
        return [(np.dtype("float8_e4m3fn"), (*lead, GROUP)), (scale_dtype, lead)]
    if codec in ("int8", "int4"):
        width = GROUP if codec == "int8" else GROUP // 2
        return [(np.dtype("uint8"), (*lead, width)), (scale_dtype, lead), (scale_dtype, lead)]
    raise KVBadFormat(f"unknown codec {codec!r}")


def _grouped(array: np.ndarray, axis: int) -> tuple[np.ndarray, int]:
    """Move ``axis`` last, pad it to a multiple of GROUP by repeating the edge, split into groups (float32)."""
    moved = np.moveaxis(array, axis, -1).astype(np.float32)
    n = moved.shape[-1]
    pad = (-n) % GROUP
    if pad:
        moved = np.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, pad)], mode="edge")
    return moved.reshape(*moved.shape[:-1], -1, GROUP), n


def _scale_dtype(*arrays: np.ndarray) -> np.dtype:
    big = max((float(np.abs(a).max(initial=0.0)) for a in arrays), default=0.0)
    return np.dtype(np.float16) if big < _FLOAT16_MAX else np.dtype(np.float32)


def _rounded(x: np.ndarray, dtype: np.dtype, up: bool) -> np.ndarray:
    """``x`` in ``dtype``, rounded toward +inf (``up``) or -inf instead of to nearest."""
    y = x.astype(dtype)
    wrong = (y < x) if up else (y > x)
    return np.where(wrong, np.nextafter(y, np.array(np.inf if up else -np.inf, dtype=dtype)), y).astype(dtype)


def _encode_fp8(desc: dict[str, Any], grouped: np.ndarray) -> EncodedTensor:
    amax = np.abs(grouped).max(axis=-1)
    scale = np.where(amax > 0, amax / _FP8_MAX, 1.0).astype(np.float32)
    sdt = _scale_dtype(scale)
    scale = _rounded(scale, sdt, up=True)  # never rounds a non-zero scale to zero
    # Divide by the stored (rounded) scale so decoding multiplies by exactly what it divided by.
    q = np.clip(grouped / scale.astype(np.float32)[..., None], -_FP8_MAX, _FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    desc["scale_dtype"] = sdt.name
    return EncodedTensor(desc, [q, scale])


def _encode_int(desc: dict[str, Any], grouped: np.ndarray, bits: int) -> EncodedTensor:
    qmax = (1 << bits) - 1
    lo = grouped.min(axis=-1)
    hi = grouped.max(axis=-1)
    sdt = _scale_dtype(lo, hi)
    # Round the minimum down and the scale up, so that every value of the group stays inside the grid.
    lo = _rounded(lo, sdt, up=False)
    scale = _rounded((hi - lo.astype(np.float32)) / qmax, sdt, up=True)
    safe = np.where(scale.astype(np.float32) > 0, scale.astype(np.float32), 1.0)
    q = np.rint((grouped - lo.astype(np.float32)[..., None]) / safe[..., None])
    q = np.clip(q, 0, qmax).astype(np.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    desc["scale_dtype"] = sdt.name
    return EncodedTensor(desc, [np.ascontiguousarray(q), scale, lo])


def _decode_int(parts: list[np.ndarray], bits: int) -> np.ndarray:
    q, scale, lo = parts
    if bits == 4:
        unpacked = np.empty((*q.shape[:-1], q.shape[-1] * 2), dtype=np.uint8)
        unpacked[..., 0::2] = q & 0x0F
        unpacked[..., 1::2] = q >> 4
        q = unpacked
    return q.astype(np.float32) * scale.astype(np.float32)[..., None] + lo.astype(np.float32)[..., None]
