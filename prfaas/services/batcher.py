"""Engine loops on one thread each, fed from the event loop: the decode instance's continuous batching
(``Batcher``) and the prefill instance's batched, chunked prefill (``PrefillScheduler``, at the end).

Each iteration: admit waiting sequences while the batch has room (a restore from transferred KV, or one chunk of a
local prefill, so a long prompt never blocks running sequences for more than one chunk), then one decode step over
every running sequence. Tokens go back to each request's asyncio queue; a request that is cancelled (client gone,
stop string seen) leaves the batch at the next step and frees its slot. With nothing to do the thread sleeps on a
queue (no busy-waiting).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prfaas.engine.batch import DecodeBatch, Row
from prfaas.errors import PrfaasError
from prfaas.messages import SamplingParams

log = logging.getLogger("prfaas.batcher")
Prepared = tuple[Any, int, int, dict[str, float]]  # cache, first token, length, stage timings


class Counter:
    """An integer changed from two threads (the event loop submits, the engine thread takes): ``+=`` on a plain
    attribute is a read-modify-write that can lose an update, so every change holds a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def add(self, delta: int) -> None:
        with self._lock:
            self._value += delta

    @property
    def value(self) -> int:
        return self._value


@dataclass
class Sequence:
    """One request in the engine loop. ``prepare`` runs on the engine thread and yields ``None`` between the
    chunks of its work, then the prepared cache. Events on ``out``: ("token", id, stages) … ("end", reason)
    or ("error", exception)."""

    seq_id: str
    prepare: Callable[[], Iterator[Prepared | None]]
    max_new: int
    sampling: SamplingParams | None
    step: int
    eos: tuple[int, ...]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[tuple[Any, ...]] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    produced: int = 0

    def emit(self, *event: Any) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, event)


class Batcher:
    def __init__(self, engine: Any, max_batch: int) -> None:
        self.batch = DecodeBatch(engine, max_batch)
        self._waiting: queue.Queue[Sequence | None] = queue.Queue()
        self._preparing: tuple[Sequence, Iterator[Prepared | None]] | None = None
        self._running: dict[str, Sequence] = {}
        self._waiting_count = Counter()
        self._thread = threading.Thread(target=self._run, name="prfaas-batcher", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        self._waiting_count.add(1)
        self._waiting.put(seq)

    @property
    def waiting(self) -> int:
        return self._waiting_count.value

    @property
    def queue_depth(self) -> int:
        return self.waiting + len(self._running)

    def close(self) -> None:
        self._waiting.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            if not self._admit():
                return
            if len(self.batch):
                self._step()

    def _admit(self) -> bool:
        """Advance admission by one unit of work; False when the loop must stop."""
        if self._preparing is None and not self.batch.full:
            idle = not len(self.batch)
            try:
                seq = self._waiting.get(block=idle, timeout=0.5 if idle else None)
            except queue.Empty:
                return True
            if seq is None:
                return False
            self._waiting_count.add(-1)
            self._preparing = (seq, seq.prepare())
        if self._preparing is not None:
            self._prepare_one_chunk(*self._preparing)
        return True

    def _prepare_one_chunk(self, seq: Sequence, work: Iterator[Prepared | None]) -> None:
        try:
            result = next(work)
        except Exception as exc:  # the request fails alone; the loop and the batch go on
            self._preparing = None
            seq.emit("error", exc if isinstance(exc, PrfaasError) else RuntimeError(str(exc)))
            if not isinstance(exc, PrfaasError):
                log.exception("preparing %s failed", seq.seq_id)
            return
        if result is None:
            if seq.cancelled.is_set():
                self._preparing = None
                seq.emit("end", "cancelled")
            return
        self._preparing = None
        cache, first, length, stages = result
        seq.produced = 1
        seq.emit("token", first, stages)
        if first in seq.eos or seq.max_new <= 1 or seq.cancelled.is_set():
            seq.emit("end", "stop" if first in seq.eos else "length")
            return
        self.batch.add(Row(seq.seq_id, length, first, seq.sampling, seq.step + 1), cache)
        self._running[seq.seq_id] = seq

    def _step(self) -> None:
        for seq in list(self._running.values()):
            if seq.cancelled.is_set():
                self._finish(seq, "cancelled")
        if not len(self.batch):
            return
        for seq_id, token in self.batch.step().items():
            seq = self._running[seq_id]
            seq.produced += 1
            seq.emit("token", token, {})
            if token in seq.eos:
                self._finish(seq, "stop")
            elif seq.produced >= seq.max_new:
                self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.batch.remove(seq.seq_id)
        del self._running[seq.seq_id]
        seq.emit("end", reason)


@dataclass
class PrefillJob:
    """One prompt for the prefill engine thread. ``on_layer`` runs on that thread as each layer is done;
    ``finish(token, seconds, error)`` runs there once at the end."""

    token_ids: list[int]
    sampling: SamplingParams | None
    on_layer: Callable[[Any], None]
    finish: Callable[[int | None, float, BaseException | None], None]


class PrefillScheduler:
    """The prefill instance's engine loop: short prompts run together in one forward pass (at most ``max_batch``
    rows and ``batch_tokens`` padded tokens), a long prompt runs ``chunk_tokens`` at a time, and the two alternate,
    so short prompts queued behind a long one wait at most one chunk. Idle, the thread sleeps on a queue."""

    def __init__(self, engine: Any, max_batch: int, batch_tokens: int, chunk_tokens: int) -> None:
        self.engine = engine
        self.max_batch, self.batch_tokens, self.chunk_tokens = max_batch, batch_tokens, chunk_tokens
        self._queue: queue.Queue[PrefillJob | None] = queue.Queue()
        self._short: list[PrefillJob] = []
        self._long: list[PrefillJob] = []
        self._chunks: tuple[PrefillJob, Iterator[Any]] | None = None
        self._depth = Counter()
        self._thread = threading.Thread(target=self._run, name="prfaas-prefill", daemon=True)
        self._thread.start()

    def submit(self, job: PrefillJob) -> None:
        self._depth.add(1)
        self._queue.put(job)

    @property
    def queue_depth(self) -> int:
        return self._depth.value

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _short_enough(self, job: PrefillJob) -> bool:
        n = len(job.token_ids)
        return n <= self.batch_tokens and (not self.chunk_tokens or n <= self.chunk_tokens)

    def _run(self) -> None:
        while True:
            busy = bool(self._short or self._long or self._chunks)
            try:
                job = self._queue.get(block=not busy)
                while True:
                    if job is None:
                        return
                    self._enqueue(job)
                    job = self._queue.get_nowait()
            except queue.Empty:
                pass
            if self._short:
                self._run_batch(self._take_batch())
            if self._chunks is None and self._long:
                job = self._long.pop(0)
                work = self.engine.prefill_chunks(job.token_ids, self.chunk_tokens, job.sampling,
                                                  on_layer=job.on_layer)
                self._chunks = (job, work)
            if self._chunks is not None:
                self._advance_chunk(*self._chunks)

    def _enqueue(self, job: PrefillJob) -> None:
        try:  # a bad prompt fails alone, before it can join a batch
            job.token_ids = self.engine.check_prompt(job.token_ids)
        except PrfaasError as exc:
            self._done(job, None, 0.0, exc)
            return
        (self._short if self._short_enough(job) else self._long).append(job)

    def _take_batch(self) -> list[PrefillJob]:
        """Jobs in arrival order that fit the bounds together (a job that does not fit waits for a later batch)."""
        batch = [self._short.pop(0)]
        width = len(batch[0].token_ids)
        for job in list(self._short):
            if len(batch) >= self.max_batch:
                break
            if max(width, len(job.token_ids)) * (len(batch) + 1) <= self.batch_tokens:
                batch.append(job)
                width = max(width, len(job.token_ids))
                self._short.remove(job)
        return batch

    def _run_batch(self, jobs: list[PrefillJob]) -> None:
        try:
            tokens, seconds = self.engine.prefill_batch(
                [j.token_ids for j in jobs], lambda row, state: jobs[row].on_layer(state),
                [j.sampling for j in jobs])
        except Exception as exc:
            if len(jobs) > 1:  # find the culprit: every job runs alone, and fails alone
                for job in jobs:
                    self._run_batch([job])
                return
            self._done(jobs[0], None, 0.0, exc)
            return
        for job, token in zip(jobs, tokens, strict=True):
            self._done(job, token, seconds, None)

    def _advance_chunk(self, job: PrefillJob, work: Iterator[Any]) -> None:
        try:
            result = next(work)
        except Exception as exc:
            self._chunks = None
            self._done(job, None, 0.0, exc)
            return
        if result is not None:
            self._chunks = None
            _, token, seconds = result
            self._done(job, token, seconds, None)

    def _done(self, job: PrefillJob, token: int | None, seconds: float, error: BaseException | None) -> None:
        self._depth.add(-1)
        if error is not None and not isinstance(error, PrfaasError):
            log.error("prefill failed: %s", error)
        job.finish(token, seconds, error)
