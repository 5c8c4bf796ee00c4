"""Shared fixtures: engines are loaded once per test session (loading is the slow part), on the device
``PRFAAS_TEST_DEVICE`` names (default cpu; ``cuda`` runs the engine tests on a GPU)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

_ENGINES: dict[str, Any] = {}


def get_engine(name: str) -> Any:
    from prfaas.engine import load_engine

    if name not in _ENGINES:
        _ENGINES[name] = load_engine(name, device=os.environ.get("PRFAAS_TEST_DEVICE", "cpu"))
    return _ENGINES[name]


def random_prompt(length: int, seed: int = 0, vocab: int = 49152) -> list[int]:
    rng = random.Random(seed * 100003 + length)
    return [rng.randrange(3, vocab) for _ in range(length)]


@pytest.fixture(scope="session")
def engines() -> Iterator[Any]:
    yield get_engine
    _ENGINES.clear()
