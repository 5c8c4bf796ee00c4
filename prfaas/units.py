"""Parsing of the command-line units of docs/contracts.md: sizes, rates, durations and length lists."""

from __future__ import annotations

import re
from collections.abc import Iterable

from prfaas.errors import InvalidRequest

_SIZE = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}
_RATE = {"": 1, "bit": 1, "bps": 1, "k": 10**3, "kbit": 10**3, "m": 10**6, "mbit": 10**6,
         "g": 10**9, "gbit": 10**9, "gbps": 10**9, "t": 10**12, "tbit": 10**12}
_DURATION = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def _parse(text: str, table: dict[str, float] | dict[str, int], what: str) -> float:
    match = _NUMBER.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in table:
        units = ", ".join(sorted(u for u in table if u))
        raise InvalidRequest(f"cannot read {what} {text!r}: expected a number with one of: {units}")
    return float(match.group(1)) * table[unit]


def parse_size(text: str | int) -> int:
    """``1GiB`` / ``512MiB`` / ``4096`` → bytes."""
    return int(_parse(str(text), _SIZE, "size"))


def parse_rate(text: str | float) -> float:
    """``10gbit`` / ``1g`` / ``500mbit`` → bits per second."""
    return _parse(str(text), _RATE, "rate")


def parse_duration(text: str | float) -> float:
    """``30s`` / ``5m`` / ``250ms`` → seconds."""
    return _parse(str(text), _DURATION, "duration")


def parse_fraction(text: str | float) -> float:
    """``0.01`` / ``1%`` → a fraction within [0, 1] (loss rates, shares)."""
    match = re.match(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(%?)\s*$", str(text), re.IGNORECASE)
    value = (float(match.group(1)) / (100 if match.group(2) else 1)) if match else -1.0
    if not 0 <= value <= 1:
        raise InvalidRequest(f"cannot read fraction {text!r}: expected a number within [0, 1] or a percentage, "
                             "e.g. 0.01 or 1%")
    return value


def parse_lengths(values: Iterable[str | int]) -> list[int]:
    """Repeatable flags and comma lists both work: ``["1024,8192", "512"]`` → ``[1024, 8192, 512]``."""
    out: list[int] = []
    for value in values:
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            n = parse_size(part.lower().replace("k", "kib") if part.lower().endswith("k") else part)
            if n <= 0:
                raise InvalidRequest(f"length must be positive, got {part!r}")
            out.append(n)
    return out
