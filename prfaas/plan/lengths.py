"""Prompt-length distributions: a weighted set of lengths, from log-normal parameters, a histogram or a trace.

Specs (one string, as on the command line):
- ``lognormal:median=4096,sigma=1.0[,min=128][,max=131072][,bins=64]`` — ln(length) ~ N(ln median, sigma²),
  discretised into equal-probability bins (each bin's median);
- ``hist:1024=0.5,8192=0.3,32768=0.2`` — lengths with weights (normalised);
- ``trace:PATH`` — a file of lengths, one per line (or a JSON list, or JSONL with ``prompt_tokens`` or
  ``seq_len``);
- a plain list ``1024,8192`` — equal weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

from prfaas.errors import InvalidRequest
from prfaas.units import parse_lengths

_TRACE_KEYS = ("prompt_tokens", "seq_len", "input_length", "length")


@dataclass(frozen=True)
class LengthDist:
    """Lengths (ascending, distinct) with probabilities summing to 1."""

    lengths: tuple[int, ...]
    weights: tuple[float, ...]
    source: str = ""

    @staticmethod
    def of(pairs: dict[int, float], source: str = "") -> LengthDist:
        clean = {int(k): float(v) for k, v in pairs.items() if v > 0}
        total = sum(clean.values())
        if not clean or total <= 0 or any(k <= 0 for k in clean):
            raise InvalidRequest(f"length distribution {source!r} has no positive lengths with weight")
        keys = sorted(clean)
        return LengthDist(tuple(keys), tuple(clean[k] / total for k in keys), source)

    def mean(self) -> float:
        return sum(n * w for n, w in zip(self.lengths, self.weights, strict=True))

    def quantile(self, q: float) -> int:
        return int(self.quantile_of(self.lengths, q))

    def quantile_of(self, values: Sequence[float], q: float) -> float:
        """The ``q``-quantile over the mix of a per-length quantity (``values[i]`` for ``lengths[i]``): the
        quantity at the length quantile only where it grows with length, which an exposed transfer need not."""
        acc = 0.0
        ranked = sorted(zip(values, self.weights, strict=True))
        for value, w in ranked:
            acc += w
            if acc >= q - 1e-12:
                return value
        return ranked[-1][0]

    def to_json(self) -> dict[str, object]:
        return {"source": self.source, "mean": self.mean(), "p50": self.quantile(0.5),
                "p99": self.quantile(0.99), "points": len(self.lengths)}


def _kv_args(body: str, spec: str) -> dict[str, str]:
    out = {}
    for part in body.split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise InvalidRequest(f"cannot read {spec!r}: expected key=value, got {part!r}")
        key, value = part.split("=", 1)
        out[key.strip().lower()] = value.strip()
    return out


def lognormal(median: float, sigma: float, lo: int = 1, hi: int = 1 << 20, bins: int = 64) -> LengthDist:
    if median <= 0 or sigma < 0 or bins < 1 or lo > hi:
        raise InvalidRequest(f"bad log-normal: median={median} sigma={sigma} min={lo} max={hi} bins={bins}")
    pairs: dict[int, float] = {}
    normal = NormalDist(math.log(median), sigma) if sigma > 0 else None
    for i in range(bins):
        q = (i + 0.5) / bins
        value = median if normal is None else math.exp(normal.inv_cdf(q))
        n = min(max(round(value), lo), hi)
        pairs[n] = pairs.get(n, 0.0) + 1.0 / bins
    return LengthDist.of(pairs, f"lognormal(median={median:g}, sigma={sigma:g})")


def _trace(path: Path) -> LengthDist:
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidRequest(f"cannot read trace {path}: {exc}") from exc
    values: list[int] = []
    stripped = text.strip()
    if stripped.startswith("["):
        values = [int(v) for v in json.loads(stripped)]
    else:
        for line in stripped.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("{"):
                row = json.loads(line)
                key = next((k for k in _TRACE_KEYS if k in row), None)
                if key is None:
                    raise InvalidRequest(f"trace {path}: a JSON line has no prompt_tokens/seq_len field")
                values.append(int(row[key]))
            else:
                values.append(int(line.split(",")[0]))
    counts: dict[int, float] = {}
    for v in values:
        counts[v] = counts.get(v, 0.0) + 1.0
    return LengthDist.of(counts, f"trace:{path.name} ({len(values)} requests)")


def parse_dist(spec: str) -> LengthDist:
    """A distribution from its command-line spec (see the module doc)."""
    kind, _, body = spec.partition(":")
    kind = kind.strip().lower()
    try:
        if kind == "lognormal":
            a = _kv_args(body, spec)
            median, sigma = float(a.get("median", "4096")), float(a.get("sigma", "1.0"))
            bounds = int(a.get("min", "1")), int(a.get("max", str(1 << 20)))
            return lognormal(median, sigma, *bounds, int(a.get("bins", "64")))
        if kind in ("hist", "histogram"):
            a = _kv_args(body, spec)
            return LengthDist.of({parse_lengths([k])[0]: float(v) for k, v in a.items()}, spec)
        if kind == "trace":
            return _trace(Path(body))
    except ValueError as exc:
        raise InvalidRequest(f"cannot read length distribution {spec!r}: {exc}") from exc
    lengths = parse_lengths([spec])
    return LengthDist.of(dict.fromkeys(lengths, 1.0), spec)
