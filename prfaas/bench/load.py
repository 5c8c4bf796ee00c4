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
from prfaas.bench.target import Verify
from prfaas.errors import InvalidRequest, Unreachable
from prfaas.tls import handshake_hint

Tick = Callable[[float], None]  # called about once a second with the cell's elapsed time


def prompt(rng: random.Random, length: int, low: int, high: int) -> list[int]:
    """``length`` token ids drawn from ``[low, high)``: exact length, no tokenizer needed, no prefix reuse."""
    return [rng.randrange(low, high) for _ in range(length)]


async def run_cell(url: str, model: str, cell: Cell, matrix: Matrix, epoch: float, seed: int = 0,
                   tick: Tick | None = None, verify: Verify = True) -> list[RequestRecord]:
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

    async with httpx.AsyncClient(limits=limits, timeout=matrix.request_timeout_s, verify=verify) as client:
        workers = [asyncio.create_task(worker(client)) for _ in range(cell.concurrency)]
        ticker = asyncio.create_task(_tick(tick, started)) if tick else None
        await asyncio.gather(*workers)
        if ticker:
            ticker.cancel()
    return records


async def warm_up(url: str, model: str, matrix: Matrix, epoch: float, verify: Verify = True) -> RequestRecord:
    """One request of the matrix's longest prompt and output, not counted in any cell (as vLLM's serving benchmark
    sends a test prompt first): a fresh deployment's first request pays for its first forward passes and
    connections, and a quick cell holds one or two requests, so that one would decide its P50."""
    rng = random.Random(f"warm-up-{url}")
    body = request_body(model, prompt(rng, max(matrix.input_lens), matrix.vocab_low, matrix.vocab_high),
                        max(matrix.output_lens))
    async with httpx.AsyncClient(timeout=matrix.request_timeout_s, verify=verify) as client:
        return await send(client, url, body, epoch, matrix.request_timeout_s)


async def _tick(tick: Tick, started: float) -> None:
    while True:
        await asyncio.sleep(1.0)
        tick(time.perf_counter() - started)


async def check_target(url: str, verify: Verify = True) -> None:
    """``url`` is an http(s) base URL that answers (any status: a server that refuses ``/v1/models`` may still
    serve completions); else ``InvalidRequest`` or ``Unreachable``, before any cell runs."""
    if not url.startswith(("http://", "https://")):
        raise InvalidRequest(f"a target is an http:// or https:// base URL, got {url!r}")
    try:
        async with httpx.AsyncClient(timeout=10.0, verify=verify) as client:
            await client.get(f"{url}/v1/models")
    except httpx.HTTPError as exc:
        raise Unreachable(f"cannot connect to {url} ({type(exc).__name__}){handshake_hint(exc)}") from None


async def model_name(url: str, verify: Verify = True) -> str:
    """The first model the target lists at ``/v1/models`` ('' when it lists none or cannot say)."""
    try:
        async with httpx.AsyncClient(timeout=10.0, verify=verify) as client:
            data = (await client.get(f"{url}/v1/models")).json().get("data") or []
    except (httpx.HTTPError, ValueError):
        return ""
    return str(data[0].get("id", "")) if data else ""


async def token_bound(url: str, model: str, high: int, verify: Verify = True) -> int:
    """The end of the token-id range the target accepts in a prompt, at most ``high``: ``high`` when it takes id
    ``high - 1`` (or cannot say), else the target's vocabulary size, found by bisection over one-token prompts
    (about 17 tiny requests). The OpenAI API does not publish a vocabulary size, but every server refuses an id
    outside its vocabulary with a 4xx, so the answer is read from the target itself."""
    async with httpx.AsyncClient(timeout=60.0, verify=verify) as client:
        async def takes(token_id: int) -> bool | None:
            body = {"prompt": [token_id], "max_tokens": 1, "temperature": 0.0, **({"model": model} if model else {})}
            try:
                status = (await client.post(f"{url}/v1/completions", json=body)).status_code
            except httpx.HTTPError:
                return None
            return True if status == 200 else False if status in (400, 422) else None

        if await takes(high - 1) is not False:
            return high
        accepted, refused = 0, high - 1  # invariant: ids ≤ accepted are taken, ``refused`` is not
        while refused - accepted > 1:
            middle = (accepted + refused) // 2
            if await takes(middle):
                accepted = middle
            else:
                refused = middle
        return refused
