"""KV bytes as a function of prompt length, from a plan (exact) or from measured points (interpolated)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prfaas.errors import InvalidRequest
from prfaas.plan.kvcalc import KVPlan


@dataclass(frozen=True)
class KVCurve:
    """``segments``: (bytes per token, fixed bytes, token cap or None) per layer; or measured ``points``."""

    name: str
    segments: tuple[tuple[int, int, int | None], ...] = ()
    points: tuple[tuple[int, int], ...] = ()

    def kv_bytes(self, seq_len: int) -> int:
        if self.segments:
            return sum(fixed + per * (seq_len if cap is None else min(seq_len, cap))
                       for per, fixed, cap in self.segments)
        return _interpolate(self.points, seq_len)

    @staticmethod
    def of_plan(plan: KVPlan) -> KVCurve:
        segs = tuple((layer.bytes_per_token, layer.fixed_bytes, layer.cap) for layer in plan.layers)
        return KVCurve(f"{plan.model} ({plan.dtype})", segs)


def _interpolate(points: tuple[tuple[int, int], ...], n: int) -> int:
    """Piecewise linear through the measured points; linear extrapolation from the nearest two."""
    if len(points) == 1:
        (n0, b0), = points
        return round(b0 * n / n0)
    pairs = list(points)
    i = 0
    while i < len(pairs) - 2 and n > pairs[i + 1][0]:
        i += 1
    (n0, b0), (n1, b1) = pairs[i], pairs[i + 1]
    return max(0, round(b0 + (b1 - b0) * (n - n0) / (n1 - n0)))


def curve_from_json(data: dict[str, Any], codec: str = "none", name: str = "") -> KVCurve:
    """From ``plan kv --json`` (exact layers) or a speed profile / ``measure --json`` (kv points)."""
    if isinstance(data.get("layers"), list) and data["layers"] and "bytes_per_token" in data["layers"][0]:
        segs = tuple((int(r["bytes_per_token"]), int(r["fixed_bytes"]), r.get("tokens_cap"))
                     for r in data["layers"])
        return KVCurve(name or str(data.get("model", "kv")), segs)
    rows = data.get("kv") or [{"seq_len": r["seq_len"], "codec": codec, "bytes": r["kv_bytes"]}
                              for r in data.get("per_length", [])]
    pts = sorted({int(r["seq_len"]): int(r["bytes"]) for r in rows if r.get("codec", codec) == codec}.items())
    if not pts:
        raise InvalidRequest(f"KV file {name or data.get('model')!r} has no KV sizes for codec {codec!r}")
    return KVCurve(name or str(data.get("model", "kv")), points=tuple(pts))


def curve_from_file(path: str | Path, codec: str = "none") -> KVCurve:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"cannot read KV file {path}: {exc}") from exc
    return curve_from_json(data, codec, Path(path).stem)
