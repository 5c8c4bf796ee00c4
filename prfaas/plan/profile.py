"""Speed profiles (docs/contracts.md): ``{"model", "dtype", "hardware", "prefill": [{"seq_len", "seconds"}],
"decode": [{"batch", "tpot_seconds"}], "kv": [{"seq_len", "codec", "bytes", "encode_seconds"}]}``, as ``prfaas
measure`` writes them (``encode_seconds``, the time to cut the layers into the blob's checksummed chunks as a
prefill instance does, is optional: profiles written before it was measured have none).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prfaas.errors import InvalidRequest


def interpolate(points: tuple[tuple[int, float], ...], x: float) -> float:
    """Piecewise linear through ``points`` (sorted by x); linear extrapolation from the nearest two."""
    if not points:
        raise InvalidRequest("no points to interpolate")
    if len(points) == 1:
        x0, y0 = points[0]
        return y0 * x / x0
    i = 0
    while i < len(points) - 2 and x > points[i + 1][0]:
        i += 1
    (x0, y0), (x1, y1) = points[i], points[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class SpeedProfile:
    model: str
    dtype: str
    hardware: str
    prefill: tuple[tuple[int, float], ...]
    decode: tuple[tuple[int, float], ...]
    kv: tuple[tuple[int, str, int], ...]
    encode: tuple[tuple[int, str, float], ...] = ()

    def prefill_seconds(self, seq_len: int) -> float:
        if not self.prefill:
            raise InvalidRequest(f"profile {self.model!r} has no prefill timings")
        return interpolate(self.prefill, seq_len)

    def encode_seconds(self, seq_len: int, codec: str = "none") -> float | None:
        """Seconds to encode a ``seq_len`` prompt's blob in ``codec``; None where the profile did not time it."""
        points = tuple(sorted((n, s) for n, c, s in self.encode if c == codec))
        return interpolate(points, seq_len) if points else None

    def kv_points(self, codec: str = "none") -> tuple[tuple[int, int], ...]:
        return tuple(sorted((n, b) for n, c, b in self.kv if c == codec))

    def decode_rate(self, output_len: float, batch: int | None = None) -> float | None:
        """Requests per second one decode instance finishes, at ``batch`` (default: the largest measured)."""
        if not self.decode:
            return None
        b = batch or self.decode[-1][0]
        tpot = interpolate(self.decode, b)
        return b / (output_len * tpot) if tpot > 0 else None

    @staticmethod
    def from_json(data: dict[str, Any], source: str = "profile") -> SpeedProfile:
        try:
            prefill = tuple(sorted((int(r["seq_len"]), float(r["seconds"])) for r in data.get("prefill", [])))
            rows = data.get("decode", [])
            decode = tuple(sorted((int(r["batch"]), float(r["tpot_seconds"])) for r in rows))
            kv = tuple((int(r["seq_len"]), str(r.get("codec", "none")), int(r["bytes"]))
                       for r in data.get("kv", []))
            encode = tuple((int(r["seq_len"]), str(r.get("codec", "none")), float(r["encode_seconds"]))
                           for r in data.get("kv", []) if r.get("encode_seconds") is not None)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"{source}: not a speed profile ({exc})") from exc
        return SpeedProfile(str(data.get("model", source)), str(data.get("dtype", "")),
                            str(data.get("hardware", "")), prefill, decode, kv, encode)

    @staticmethod
    def from_file(path: str | Path) -> SpeedProfile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidRequest(f"cannot read profile {path}: {exc}") from exc
        return SpeedProfile.from_json(data, str(path))


def phi_kv_gbps(kv_bytes: float, prefill_seconds: float) -> float:
    """Φ_kv = KV bytes / prefill time, in Gbps (10⁹ bits per second)."""
    return kv_bytes * 8 / prefill_seconds / 1e9
