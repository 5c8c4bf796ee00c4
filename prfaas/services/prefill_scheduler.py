"""The prefill instance's engine loop on one thread, fed from the event loop: batched, chunked prefill."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prfaas.errors import PrfaasError
from prfaas.messages import SamplingParams
from prfaas.services.counter import Counter

if TYPE_CHECKING:  # the protocol's name only: importing prfaas.engine at run time loads torch
    from prfaas.engine.protocol import ChunkResult, Engine, LayerCallback

log = logging.getLogger("prfaas.prefill_scheduler")


@dataclass
class PrefillJob:
    """One prompt for the prefill engine thread. ``on_layer`` runs on that thread as each layer is done;
    ``finish(token, seconds, error)`` runs there once at the end."""

    token_ids: list[int]
    sampling: SamplingParams | None
    on_layer: LayerCallback
    finish: Callable[[int | None, float, BaseException | None], None]


class PrefillScheduler:
    """The prefill instance's engine loop: short prompts run together in one forward pass (at most ``max_batch``
    rows and ``batch_tokens`` padded tokens), a long prompt runs ``chunk_tokens`` at a time, and the two alternate,
    so short prompts queued behind a long one wait at most one chunk. Idle, the thread sleeps on a queue."""

    def __init__(self, engine: Engine, max_batch: int, batch_tokens: int, chunk_tokens: int) -> None:
        self.engine = engine
        self.max_batch, self.batch_tokens, self.chunk_tokens = max_batch, batch_tokens, chunk_tokens
        self._queue: queue.Queue[PrefillJob | None] = queue.Queue()
        self._short: list[PrefillJob] = []
        self._long: list[PrefillJob] = []
        self._chunks: tuple[PrefillJob, Iterator[ChunkResult | None]] | None = None
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

    def _advance_chunk(self, job: PrefillJob, work: Iterator[ChunkResult | None]) -> None:
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
