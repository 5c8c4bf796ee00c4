"""A closed-loop load: ``concurrency`` workers, each sending one request after another, until the cell's
duration has passed (no new request starts after it) or its request count is reached. Bounded: every request has
a timeout, so a cell ends at most ``duration + timeout`` after it starts.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable

import httpx

from prfaas.bench.client import RequestRecord, request_body, send
from prfaas.bench.matrix import Cell, Matrix

Tick = Callable[[float], None]  # called about once a second with the cell's elapsed time


def prompt(rng: random.Random, length: int, low: int, high: int) -> list[int]:
    """``length`` token ids drawn from ``[low, high)``: exact length, no tokenizer needed, no prefix reuse."""
    return [rng.randrange(low, high) for _ in range(length)]


async def run_cell(url: str, model: str, cell: Cell, matrix: Matrix, epoch: float, seed: int = 0,
                   tick: Tick | None = None) -> list[RequestRecord]:
    """Run one cell against ``url``; return every request's record (failures included)."""
    rng = random.Random(f"{seed}-{cell.key}")
    records: list[RequestRecord] = []
    started = time.perf_counter()
    budget = {"left": matrix.requests if matrix.requests is not None else sys.maxsize}
    limits = httpx.Limits(max_connections=cell.concurrency + 4, max_keepalive_connections=cell.concurrency)

    def more() -> bool:
        within = matrix.duration_s is None or time.perf_counter() - started < matrix.duration_s
        if within and budget["left"] > 0:
            budget["left"] -= 1
            return True
        return False

    async def worker(client: httpx.AsyncClient) -> None:
        while more():
            body = request_body(model, prompt(rng, cell.input_len, matrix.vocab_low, matrix.vocab_high),
                                cell.output_len)
            records.append(await send(client, url, body, epoch, matrix.request_timeout_s))

    async with httpx.AsyncClient(limits=limits, timeout=matrix.request_timeout_s) as client:
        workers = [asyncio.create_task(worker(client)) for _ in range(cell.concurrency)]
        ticker = asyncio.create_task(_tick(tick, started)) if tick else None
        await asyncio.gather(*workers)
        if ticker:
            ticker.cancel()
    return records


async def _tick(tick: Tick, started: float) -> None:
    while True:
        await asyncio.sleep(1.0)
        tick(time.perf_counter() - started)


async def model_name(url: str) -> str:
    """The first model the target lists at ``/v1/models`` ('' when it lists none or cannot say)."""
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            data = (await client.get(f"{url}/v1/models")).json().get("data") or []
    except (httpx.HTTPError, ValueError):
        return ""
    return str(data[0].get("id", "")) if data else ""
