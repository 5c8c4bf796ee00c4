"""Percentiles and jitter of RTT samples."""

from __future__ import annotations

import itertools
import math


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def jitter(samples: list[float]) -> float:
    """Mean absolute difference of consecutive samples (RFC 3550's idea, without smoothing)."""
    if len(samples) < 2:
        return 0.0
    return sum(abs(b - a) for a, b in itertools.pairwise(samples)) / (len(samples) - 1)
