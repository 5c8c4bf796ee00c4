"""One engine, one compute thread: model calls run off the event loop, one at a time, in arrival order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class EngineRunner:
    """Serialises engine work on a single thread; ``queue_depth`` counts calls waiting or running."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prfaas-engine")
        self.queue_depth = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        self.queue_depth += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.queue_depth -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
