"""Prefill speed by prompt length: from a ``prfaas measure`` speed profile, refined online from real prefills.

Prefill time grows a little faster than linearly (attention is quadratic); between measured lengths the model
interpolates seconds per token linearly, and beyond them it extrapolates the nearest rate. What is learnt online is
the median rate of the last ``WINDOW`` prefills: in a two-decode deployment on two cores one local prefill of six
took 224 ms against about 9 ms for the others, and an average carried that stall into the placements after it.
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections import deque
from pathlib import Path
from typing import Any

DEFAULT_S_PER_TOKEN = 0.001
WINDOW = 15  # prefills the online rate is the median of


class PrefillSpeed:
    def __init__(self, points: list[tuple[int, float]] | None = None) -> None:
        self._points = sorted((n, s / n) for n, s in (points or []) if n > 0 and s > 0)
        self._rates: deque[float] = deque(maxlen=WINDOW)

    @classmethod
    def from_profile(cls, path: str | Path) -> PrefillSpeed:
        data: dict[str, Any] = json.loads(Path(path).read_text())
        return cls([(int(p["seq_len"]), float(p["seconds"])) for p in data.get("prefill", [])])

    def fresh(self) -> PrefillSpeed:
        """A copy of the measured profile without what was learnt online: the start of a new instance's speed."""
        return PrefillSpeed([(n, rate * n) for n, rate in self._points])

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._rates.append(seconds / tokens)

    @property
    def online(self) -> float | None:
        """The learnt seconds per token (None before any prefill)."""
        return statistics.median(self._rates) if self._rates else None

    def seconds(self, tokens: int) -> float:
        """Expected prefill time of a prompt of ``tokens`` tokens."""
        return tokens * self._rate(tokens)

    def _rate(self, tokens: int) -> float:
        online = self.online
        if not self._points:
            return online if online is not None else DEFAULT_S_PER_TOKEN
        lengths = [n for n, _ in self._points]
        i = bisect.bisect_left(lengths, tokens)
        if i == 0:
            rate = self._points[0][1]
        elif i == len(self._points):
            rate = self._points[-1][1]
        else:
            (n0, r0), (n1, r1) = self._points[i - 1], self._points[i]
            rate = r0 + (r1 - r0) * (tokens - n0) / (n1 - n0)
        if online is not None:  # scale the profile's shape by what this deployment really does
            return 0.5 * rate + 0.5 * online
        return rate
