"""The decode engine loop alone: a load of prompts through ``DecodeScheduler`` in this process, with no HTTP, router
or text streaming around it, so a benchmark can set the serving path's cost beside a served deployment's rows
(``benchmarks/engine.py``'s ``prfaas in process``).

    python -m prfaas.bench.inprocess --model smollm2-135m [--dtype auto] [--batch 64]

Prints ``{"ready": dtype}`` once the engine is loaded, then answers each line on stdin, ``{"concurrency": c,
"prompts": [[token id, ...], ...], "max_tokens": n}``, with one line: ``{"wall": s, "runs": [{"ttft": s, "tpot": s,
"tokens": n}, ...]}``, or ``{"error": message}`` for a line it cannot run. ``c`` clients each submit their next
prompt when their last one ends, as a served load's clients do; every prompt is prefilled on this engine thread as
the decode service prefills a local prompt: in chunks of ``prefill_chunk_tokens`` while other sequences run, in one
pass otherwise, its passes carrying the running rows' step where the engine folds; greedy, no end-of-sequence stop.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prfaas.config import PrefillConfig
from prfaas.services import http
from prfaas.services.decode_scheduler import DecodeScheduler, Prepared, Sequence

if TYPE_CHECKING:  # the protocol's name only: importing prfaas.engine at run time loads torch
    from prfaas.engine.protocol import Engine


class InProcess:
    """One engine and its decode loop, driven by loads (``run``)."""

    def __init__(self, engine: Engine, max_batch: int, chunk_tokens: int) -> None:
        self.engine, self.chunk_tokens = engine, chunk_tokens
        self.scheduler = DecodeScheduler(engine, max_batch)

    def close(self) -> None:
        self.scheduler.close()

    def _prepare(self, ids: list[int]) -> Iterator[Prepared | None]:
        """On the engine thread, as ``DecodeService`` prefills a local prompt."""
        for result in self.engine.prefill_chunks(ids, self.scheduler.local_chunk(self.chunk_tokens)):
            if result is None:
                yield None
                continue
            cache, first, _ = result
            yield cache, first, len(ids), {}

    async def run(self, concurrency: int, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        gate = asyncio.Semaphore(concurrency)

        async def one(index: int, ids: list[int]) -> dict[str, float]:
            async with gate:
                seq = Sequence(seq_id=f"r{index}", prepare=functools.partial(self._prepare, ids), max_new=max_tokens,
                               sampling=None, step=0, eos=(), loop=loop)
                started, stamps = time.perf_counter(), []
                self.scheduler.submit(seq)
                while True:
                    kind, *rest = await seq.out.get()
                    if kind == "error":
                        raise rest[0]
                    if kind == "end":
                        break
                    stamps.append(time.perf_counter())
            tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
            return {"ttft": stamps[0] - started, "tpot": tpot, "tokens": len(stamps)}

        started = time.perf_counter()
        runs = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
        return {"wall": time.perf_counter() - started, "runs": runs}

    def answer(self, line: str) -> dict[str, Any]:
        """One request line's reply (the module docstring's)."""
        try:
            request = json.loads(line)
            concurrency, max_tokens = int(request["concurrency"]), int(request["max_tokens"])
            prompts = [[int(t) for t in ids] for ids in request["prompts"]]
            if concurrency < 1 or max_tokens < 1 or not prompts:
                raise ValueError("concurrency, max_tokens and the number of prompts must be at least 1")
            for ids in prompts:
                self.engine.check_prompt(ids)  # empty, too long, ids outside the vocab
            return http.run(self.run(concurrency, prompts, max_tokens))  # the event loop the roles run
        except Exception as exc:  # a bad line fails alone; the loop reads the next one
            return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prfaas.bench.inprocess", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=64, help="decode_max_batch")
    parser.add_argument("--chunk-tokens", type=int, default=PrefillConfig().prefill_chunk_tokens,
                        help="prefill_chunk_tokens (a local prompt's pass while other sequences run)")
    args = parser.parse_args(argv)
    from prfaas.engine import load_engine

    engine = load_engine(args.model, dtype=args.dtype)
    driver = InProcess(engine, args.batch, args.chunk_tokens)
    try:
        print(json.dumps({"ready": engine.fingerprint.dtype}), flush=True)
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(driver.answer(line)), flush=True)
    finally:
        driver.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
