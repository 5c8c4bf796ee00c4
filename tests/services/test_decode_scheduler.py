"""The decode engine loop's hand-over to the event loop: a step's tokens arrive in one wake-up, in order, each
sequence's stream ending after its last token."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from typing import Any

from prfaas.services.decode_scheduler import DecodeScheduler, Prepared, Sequence
from tests.conftest import random_prompt


def test_a_steps_tokens_reach_the_event_loop_in_one_wake_up(engines: Any) -> None:
    engine = engines("tiny-llama")
    prompts = {f"s{i}": random_prompt(20 + 7 * i, seed=i) for i in range(3)}
    lengths = {"s0": 4, "s1": 9, "s2": 6}

    async def run() -> tuple[dict[str, list[Any]], int]:
        loop = asyncio.get_running_loop()
        calls = [0]
        handover = loop.call_soon_threadsafe

        def counted(callback: Any, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return handover(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
        scheduler = DecodeScheduler(engine, 4)

        def prepare(ids: list[int]) -> Iterator[Prepared | None]:
            cache, first, _ = engine.prefill_cache(ids)
            yield cache, first, len(ids), {}

        seqs = [Sequence(seq_id=name, prepare=functools.partial(prepare, ids), max_new=lengths[name], sampling=None,
                         step=0, eos=(), loop=loop) for name, ids in prompts.items()]
        try:
            for seq in seqs:
                scheduler.submit(seq)
            events: dict[str, list[Any]] = {}
            for seq in seqs:
                got = events.setdefault(seq.seq_id, [])
                while not got or got[-1][0] != "end":
                    got.append(await asyncio.wait_for(seq.out.get(), 60))
        finally:
            scheduler.close()
        return events, calls[0]

    events, calls = asyncio.run(run())
    for name, got in events.items():
        assert got[-1] == ("end", "length")
        tokens = [event[1] for event in got[:-1]]
        assert all(event[0] == "token" for event in got[:-1])
        assert tokens == engine.generate(prompts[name], lengths[name])  # greedy, as a monolithic run
    # a hand-over per prefill's first token and one per pass that steps the batch (each admission's pass can, and
    # then one per token of the longest), not one per event: 22 events here
    assert calls <= 2 * len(prompts) - 1 + max(lengths.values()) < sum(len(got) for got in events.values())
