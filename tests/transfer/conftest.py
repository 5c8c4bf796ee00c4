from __future__ import annotations

from collections.abc import Iterator

import pytest

from prfaas.transfer import stats


@pytest.fixture(autouse=True)
def fresh_link_stats() -> Iterator[None]:
    """Each test starts with an empty retry window (the global retry cap counts per process)."""
    stats.reset()
    yield
    stats.reset()
