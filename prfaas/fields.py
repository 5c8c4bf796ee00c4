"""Checks of single JSON fields, shared by every parser of a request body: the OpenAI surface
(``prfaas.services.openai_api``) and the internal messages between roles (``prfaas.messages``), so a field means
the same and is refused the same wherever it arrives. Ground floor: imports nothing of prfaas but its errors.

JSON is taken literally: a boolean is ``true``/``false`` (never ``"no"`` or ``1``), an integer is not a boolean,
a number is finite (``NaN``/``Infinity`` are refused even though Python's JSON parser accepts them). Every refusal
is ``InvalidRequest`` (400) naming the field.
"""

from __future__ import annotations

import math
from typing import Any

from prfaas.errors import InvalidRequest


def boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be a JSON boolean (true or false), not {_shown(value)}", name)
    return value


def integer(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be an integer within [{lo}, {hi}], not {_shown(value)}", name)
    return value


def number(value: Any, name: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be a number within [{lo:g}, {hi:g}], not {_shown(value)}", name)
    return float(value)


def text(value: Any, name: str, max_len: int = 4096) -> str:
    if not isinstance(value, str) or len(value) > max_len:
        raise InvalidRequest(f"'{name}' must be a string of at most {max_len} characters", name)
    return value


def token_ids(value: Any, name: str) -> list[int]:
    """A non-empty list of non-negative integer token ids (the engine checks them against its vocabulary)."""
    if not isinstance(value, list) or not value or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise InvalidRequest(f"'{name}' must be a non-empty list of non-negative integer token ids", name)
    return value


def strings(value: Any, name: str, max_items: int) -> list[str]:
    if not isinstance(value, list) or len(value) > max_items or not all(isinstance(s, str) for s in value):
        raise InvalidRequest(f"'{name}' must be a list of at most {max_items} strings", name)
    return value


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."
