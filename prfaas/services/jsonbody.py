"""The one place an HTTP request body becomes JSON, for every role's app.

``read(request)`` reads the body (``BodyLimit`` has already bounded its size), then ``parse`` refuses with
``InvalidRequest`` (400) what Python's ``json`` would accept or fail on in a way the app cannot render:

- bytes that are not UTF-8 (``json.loads`` on bytes raises ``UnicodeDecodeError``, not a JSON error);
- text that is not JSON, including ``NaN``/``Infinity``, numbers that overflow to infinity and integers over
  Python's digit limit (a ``ValueError`` of its own);
- nesting deeper than ``limits.max_json_depth``, even in a field nobody reads (the C scanner recurses and raises
  ``RecursionError`` near a thousand levels; well before that, nothing prfaas accepts is nested more than a few);
- a lone surrogate escape (``"\\ud800"``) in any string or key: it decodes to a Python ``str`` that cannot be
  encoded to UTF-8, so forwarding it (the router's call to ``/tokenize``) or tokenising it would fail later.

The checks after parsing cost one type check per value and a regular-expression scan of the raw bytes. Parsing
itself runs on the event loop (``json`` holds the GIL, so a thread would not help): its cost is bounded by
``limits.max_body_bytes`` — a few hundred milliseconds for a 16 MiB prompt, seconds for 16 MiB of millions of
tiny values; lower the limit where that matters.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from prfaas.errors import InvalidRequest
from prfaas.security.guards import limits_of

_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_CONTAINERS = (dict, list)


async def read(request: Request) -> Any:
    """The request's body as JSON; ``InvalidRequest`` when it is not acceptable JSON (see the module docstring)."""
    try:
        raw = await request.body()
    except ClientDisconnect as exc:  # the peer left (or the body timed out): the answer reaches nobody
        raise InvalidRequest("the connection closed before the whole body arrived") from exc
    return parse(raw, limits_of(request.app).max_json_depth)


async def read_object(request: Request) -> dict[str, Any]:
    """``read``, for a route whose body must be a JSON object."""
    value = await read(request)
    if not isinstance(value, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return value


def parse(raw: bytes, max_depth: int) -> Any:
    """``raw`` as JSON, checked as the module docstring says."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise InvalidRequest(f"the body is nested more than {max_depth} levels deep") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    except ValueError:  # int() over Python's digit limit (sys.get_int_max_str_digits)
        raise InvalidRequest("the body is not valid JSON: a number in it has too many digits") from None
    _depth(value, max_depth)
    if _ESCAPED_SURROGATE.search(raw):  # only a \uD800-\uDFFF escape makes one; most bodies have none
        _strings(value)
    return value


def _no_constant(name: str) -> Any:
    raise InvalidRequest(f"the body is not valid JSON: {name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidRequest(f"the body is not valid JSON: the number {text[:40]} is out of range")
    return value


def _depth(value: Any, max_depth: int) -> None:
    """Refuse ``value`` nested deeper than ``max_depth``: one level at a time, so each element costs one type check
    and nothing recurses (the parsed value may be up to ~1000 levels deep)."""
    level = [value] if type(value) in _CONTAINERS else []
    for _ in range(max_depth):
        inner: list[Any] = []
        for item in level:
            inner.extend(item.values() if type(item) is dict else item)
        level = [child for child in inner if type(child) in _CONTAINERS]
        if not level:
            return
    raise InvalidRequest(f"the body is nested more than {max_depth} levels deep")


def _strings(value: Any) -> None:
    """Refuse a lone surrogate in any string or key of ``value`` (already bounded in depth)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is str:
            _text(item)
        elif type(item) is dict:
            for key in item:
                _text(key)
            stack.extend(item.values())
        elif type(item) is list:
            stack.extend(item)


def _text(text: str) -> None:
    found = _SURROGATE.search(text)
    if found is not None:
        raise InvalidRequest(f"the body holds a lone surrogate \\u{ord(found.group()):04x}, which is not text "
                             "(it has no UTF-8 encoding)")
