"""Property-based fuzzing of what arrives from the wire: the KV blob parser, the data-plane messages and the OpenAI
request parser. Any input either parses or raises a ``PrfaasError``; nothing else, and no unbounded allocation
(a length field never makes the parser allocate more than the reader's byte limit)."""

from __future__ import annotations

import tracemalloc
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prfaas.errors import PrfaasError
from prfaas.kv.format import BlobReader, parse_header, parse_trailer
from prfaas.services import openai_api
from prfaas.transfer import protocol as p
from tests.transfer.helpers import blob_frames, make_state

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_, FRAMES = blob_frames(make_state(layers=2, tokens=16), chunk_size=4096)
BLOB = b"".join(FRAMES)
MAX_READER_BYTES = 1 << 20


def _mutate(data: bytes, flips: list[tuple[int, int]], cut: int) -> bytes:
    buf = bytearray(data[:max(0, min(cut, len(data)))])
    for pos, value in flips:
        if buf:
            buf[pos % len(buf)] = value
    return bytes(buf)


def _bounded(call: Any, limit: int = 64 << 20) -> None:
    tracemalloc.start()
    try:
        call()
    except PrfaasError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < limit, f"parser allocated {peak} bytes"


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=8), st.integers(0, len(BLOB)))
def test_blob_reader_survives_mutated_blobs(flips: list[tuple[int, int]], cut: int) -> None:
    data = _mutate(BLOB, flips, cut)
    _bounded(lambda: BlobReader(max_bytes=MAX_READER_BYTES).feed(data))


@FUZZ
@given(st.binary(max_size=4096))
def test_blob_reader_survives_random_bytes(data: bytes) -> None:
    _bounded(lambda: BlobReader(max_bytes=MAX_READER_BYTES).feed(b"PRKV" + data))
    _bounded(lambda: BlobReader(max_bytes=MAX_READER_BYTES).feed(data))


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6), st.integers(0, 1 << 16))
def test_header_and_trailer_parsers(flips: list[tuple[int, int]], cut: int) -> None:
    _bounded(lambda: parse_header(_mutate(FRAMES[0], flips, cut)))
    _bounded(lambda: parse_trailer(_mutate(FRAMES[-1], flips, cut)))


MESSAGES = [p.Put("k" * 10, 100), p.Get("k" * 10, 0, 100), p.Release("k" * 10), p.Stat(), p.Ok()]


@FUZZ
@given(st.sampled_from(MESSAGES), st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 255)), max_size=6),
       st.integers(0, 4096))
def test_protocol_messages(message: p.Message, flips: list[tuple[int, int]], cut: int) -> None:
    body = p.encode(message)[p._MSG_HEAD.size:]
    _bounded(lambda: p.decode(_mutate(body, flips, cut)))


@FUZZ
@given(st.binary(max_size=2048))
def test_protocol_random_bodies(body: bytes) -> None:
    _bounded(lambda: p.decode(body))


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                 max_size=4), max_leaves=20)
KEYS = st.sampled_from(["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "stop",
                        "stream", "stream_options", "ignore_eos", "n", "role", "content"])


@FUZZ
@given(st.dictionaries(KEYS, JSON, max_size=8) | JSON, st.booleans())
def test_openai_request_parser(body: Any, chat: bool) -> None:
    _bounded(lambda: openai_api.parse(body, chat))
