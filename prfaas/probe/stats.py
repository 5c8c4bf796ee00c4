"""Percentiles and jitter of RTT samples."""

from __future__ import annotations

import itertools
import math

import numpy as np


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100: always one of the samples); NaN for no samples."""
    return float(np.percentile(samples, q, method="inverted_cdf")) if samples else math.nan


def jitter(samples: list[float]) -> float:
    """Mean absolute difference of consecutive samples (RFC 3550's idea, without smoothing)."""
    if len(samples) < 2:
        return 0.0
    return sum(abs(b - a) for a, b in itertools.pairwise(samples)) / (len(samples) - 1)
