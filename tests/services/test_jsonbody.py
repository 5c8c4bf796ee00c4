"""The request-body JSON boundary (``prfaas.services.jsonbody``): what Python's json would turn into a 500 — bytes
that are not UTF-8, nesting deep enough for a ``RecursionError``, a lone surrogate, an integer over the digit
limit, ``NaN`` — is ``InvalidRequest``; any other input parses to what ``json`` gives, or is ``InvalidRequest``."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prfaas.errors import InvalidRequest
from prfaas.services.jsonbody import parse

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(), lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                                               max_size=4),
                    max_leaves=20)


def nested(depth: int, inner: str = "1") -> bytes:
    return ("[" * depth + inner + "]" * depth).encode()


@pytest.mark.parametrize(("raw", "words"), [
    (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    (b'{"prompt": "\\ud800"}', "lone surrogate \\ud800"),
    (b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "lone surrogate \\udfff"),
    (b'{"\\udc00": 1}', "lone surrogate"),
    (b'{"prompt": "hi", "ignored": ' + nested(5000) + b"}", "nested more than 64 levels"),
    (nested(65), "nested more than 64 levels"),
    (b'{"x": ' + b"1" * 5000 + b"}", "too many digits"),
    (b'{"temperature": NaN}', "NaN is not a JSON number"),
    (b'{"temperature": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"temperature": 1e999}', "out of range"),
    (b"", "not valid JSON"),
    (b'{"prompt": "hi"', "not valid JSON"),
])
def test_refused_with_invalid_request(raw: bytes, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words.replace("\\", "\\\\")):
        parse(raw, 64)


def test_accepted_edges() -> None:
    assert parse(nested(64), 64) == json.loads(nested(64))
    assert parse(b'{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}', 64) == {"a": "\U0001f600", "b": "\\ud800"}
    assert parse("{\"prompt\": \"héllo ☃\"}".encode(), 64) == {"prompt": "héllo ☃"}


@FUZZ
@given(JSON)
def test_round_trips_what_json_writes(value: Any) -> None:
    for raw in (json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")):
        try:
            assert parse(raw, 64) == value
        except InvalidRequest as exc:  # only a string hypothesis drew with a lone surrogate
            assert "surrogate" in exc.message or "UTF-8" in exc.message


@FUZZ
@given(st.binary(max_size=512))
def test_any_bytes_parse_or_are_invalid_request(raw: bytes) -> None:
    with contextlib.suppress(InvalidRequest):
        parse(raw, 64)
