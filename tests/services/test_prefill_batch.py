"""The prefill engine loop: short prompts queued together share one forward pass, a long prompt is chunked so
short ones queued behind it finish first, and every prompt's shipped KV decodes like a monolithic run."""

from __future__ import annotations

import threading

from prfaas.errors import InvalidRequest
from prfaas.kv import KVState, decode_state, encode_state
from prfaas.services.prefill_scheduler import PrefillJob, PrefillScheduler
from tests.conftest import random_prompt


class Collect:
    """What one job's callbacks received, in the order they ran on the engine thread."""

    def __init__(self, name: str, log: list[tuple[str, object]], ended: threading.Event, expect: int) -> None:
        self.name, self.log, self.ended, self.expect = name, log, ended, expect
        self.layers: list = []
        self.result: tuple = ()

    def on_layer(self, state) -> None:
        self.layers.append(state)
        self.log.append((self.name, state.index))

    def finish(self, token, seconds, error) -> None:
        self.result = (token, seconds, error)
        self.log.append((self.name, "end"))
        if sum(1 for _, what in self.log if what == "end") == self.expect:
            self.ended.set()

    def job(self, ids: list[int]) -> PrefillJob:
        return PrefillJob(ids, None, self.on_layer, self.finish)


def test_short_prompts_batch_together_and_pass_a_long_one(engines) -> None:
    engine = engines("tiny-llama")
    long_ids = random_prompt(1600, seed=1)
    shorts = {f"s{i}": random_prompt(n, seed=10 + i) for i, n in enumerate((40, 9, 100))}
    log: list[tuple[str, object]] = []
    ended = threading.Event()
    jobs = {name: Collect(name, log, ended, 6) for name in ["hold", "long", *shorts, "bad"]}
    holding, release = threading.Event(), threading.Event()

    def hold(state) -> None:  # the engine thread waits in this job's pass until the others are queued together
        holding.set()
        assert release.wait(30)
    scheduler = PrefillScheduler(engine, max_batch=8, batch_tokens=2048, chunk_tokens=128)
    try:
        scheduler.submit(PrefillJob(random_prompt(20, seed=2), None, hold, jobs["hold"].finish))
        assert holding.wait(30)
        scheduler.submit(jobs["long"].job(long_ids))
        for name, ids in shorts.items():
            scheduler.submit(jobs[name].job(ids))
        scheduler.submit(jobs["bad"].job([1, 10**9]))  # fails alone, the batch it joined goes on
        release.set()
        assert ended.wait(120)
    finally:
        release.set()
        scheduler.close()
    assert not scheduler._thread.is_alive() and scheduler.queue_depth == 0
    ends = [name for name, what in log if what == "end"]
    assert ends[0] == "hold" and ends[-1] == "long", ends  # queued before the short ones, it finished after them
    short_layers = [(name, what) for name, what in log if name in shorts and what != "end"]
    # one forward pass for the three: layer 0 of every one before layer 1 of any
    assert [what for _, what in short_layers] == sorted(what for _, what in short_layers)
    assert isinstance(jobs["bad"].result[2], InvalidRequest)
    for name, ids in [("long", long_ids), *shorts.items()]:
        token, _, error = jobs[name].result
        assert error is None
        kv = KVState(fingerprint=engine.fingerprint, seq_len=len(ids), layers=jobs[name].layers,
                     cache=engine.cache_class, first_token=token)
        assert [token, *engine.decode(decode_state(encode_state(kv)), token, 3)] == engine.generate(ids, 4)


def test_bounds_split_a_queue_into_batches(engines) -> None:
    engine = engines("tiny-llama")
    log: list[tuple[str, object]] = []
    ended = threading.Event()
    prompts = {f"p{i}": random_prompt(60, seed=i) for i in range(5)}
    jobs = {name: Collect(name, log, ended, len(prompts)) for name in prompts}
    scheduler = PrefillScheduler(engine, max_batch=2, batch_tokens=4096, chunk_tokens=512)
    gate = threading.Event()
    blocker = PrefillJob(random_prompt(8), None, lambda state: gate.wait(30), lambda *a: None)
    try:
        scheduler.submit(blocker)  # holds the engine thread until all five are queued
        for name, ids in prompts.items():
            scheduler.submit(jobs[name].job(ids))
        gate.set()
        assert ended.wait(60)
    finally:
        scheduler.close()
    ends = [name for name, what in log if what == "end"]
    assert ends == list(prompts)  # arrival order kept: batches of 2, 2, 1
    first_pass = [name for name, what in log[: 2 * engine.num_layers]]
    assert sorted(set(first_pass)) == ["p0", "p1"]


def test_an_idle_engine_thread_drops_expired_prefixes_on_time(engines) -> None:
    """With nothing queued, the prefill loop sweeps its prefix cache: a prefix past its TTL is deleted (and leaves
    the heartbeat's summary) without waiting for the next prompt; the decode loop's idle callback runs likewise."""
    from prfaas.engine.prefix_prefill import PrefixPrefill
    from prfaas.engine.prefix_records import PrefixLifecycle
    from prfaas.records import EXPIRED, PREFIX_DELETED
    from prfaas.services.decode_scheduler import DecodeScheduler
    from tests.clock import Clock

    engine, clock, records = engines("tiny-llama"), Clock(), []
    prefix = PrefixPrefill(engine, 64 << 20, "test", lifecycle=PrefixLifecycle(60, sink=records.append, clock=clock))
    ended = threading.Event()
    done = Collect("one", [], ended, 1)
    scheduler = PrefillScheduler(engine, max_batch=8, batch_tokens=2048, chunk_tokens=128, prefix=prefix)
    try:
        scheduler.submit(done.job(random_prompt(100, seed=5)))
        assert ended.wait(60) and done.result[2] is None
        assert prefix.summary()
        clock.now += 61
        for _ in range(100):
            if not prefix.summary():
                break
            threading.Event().wait(0.1)
        assert not prefix.summary() and prefix.cache.nbytes == 0
        assert [r.reason for r in records if r.kind == PREFIX_DELETED] == [EXPIRED]
    finally:
        scheduler.close()
    swept = threading.Event()
    decode = DecodeScheduler(engine, 4, idle=swept.set)
    try:
        assert swept.wait(10)
    finally:
        decode.close()
