"""The prefill instance's engine loop on one thread, fed from the event loop: batched, chunked prefill, in the
weighted fair order of the client clusters that sent the prompts (``prfaas.services.fair_queue``), each long prompt
cut into passes only where that order needs a switch point."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prfaas.errors import PrfaasError
from prfaas.messages import SamplingParams
from prfaas.services.counter import Counter
from prfaas.services.fair_queue import FairQueue
from prfaas.tenancy.clusters import ClusterPolicy

if TYPE_CHECKING:  # the protocol's name only: importing prfaas.engine at run time loads torch
    from prfaas.engine.prefix_prefill import PrefixPrefill
    from prfaas.engine.protocol import ChunkPlan, ChunkResult, Engine, LayerCallback

log = logging.getLogger("prfaas.prefill_scheduler")
SWEEP_S = 1.0  # an idle engine thread with a prefix cache drops expired prefixes this often (PrefixPrefill.sweep)


@dataclass
class PrefillJob:
    """One prompt for the prefill engine thread. ``on_layer`` runs on that thread as each layer is done;
    ``finish(token, seconds, error)`` runs there once at the end. ``cluster``: whose prompt it is (its share and
    priority order the queue)."""

    token_ids: list[int]
    sampling: SamplingParams | None
    on_layer: LayerCallback
    finish: Callable[[int | None, float, BaseException | None], None]
    cluster: ClusterPolicy = field(default_factory=ClusterPolicy)
    tenant: str = ""  # whose prompt: it reuses only this tenant's cached prefixes
    started: float = 0.0  # perf_counter when it left the queue for the engine (set on the engine thread)


class PrefillScheduler:
    """The prefill instance's engine loop. Each step runs a batch of short prompts, then one pass of a long one, so
    short prompts queued behind a long one wait at most one pass; which ones is the clusters' fair order
    (``FairQueue``, arrival order within one cluster). The batch: the first short prompt in that order and the short
    ones after it that fit (at most ``max_batch`` rows and ``batch_tokens`` padded tokens). The pass: of the first
    long prompt in that order, which stays queued in its rank, so between two passes a long prompt ranked ahead of
    it (an under-share cluster's new one) takes the engine (at most one prompt in parts per cluster: a cluster's
    own later prompts rank behind its earlier one).

    The size of each pass is chosen when it starts (``_next_pass``): with nothing else waiting, the rest of the
    prompt in one pass (a pass after the first attends through an explicit causal mask, several times slower on a
    CPU, and each pass re-reads the weights); with anything else waiting, ``chunk_tokens``. The price: a prompt that
    arrives during a lone prompt's single pass waits for that pass to end (as every prompt waited for a long one
    before); one that arrives while others wait waits at most one chunk. Idle, the thread sleeps on a queue."""

    def __init__(self, engine: Engine, max_batch: int, batch_tokens: int, chunk_tokens: int,
                 prefix: PrefixPrefill | None = None) -> None:
        self.engine = engine
        self.prefix = prefix  # with a prefix cache, a prompt of a block or more runs alone, through the cache
        self.max_batch, self.batch_tokens, self.chunk_tokens = max_batch, batch_tokens, chunk_tokens
        self._queue: queue.Queue[PrefillJob | None] = queue.Queue()
        self._waiting: FairQueue[PrefillJob] = FairQueue()
        self._parts: dict[int, Iterator[ChunkResult | None]] = {}  # id(job) → its passes, for prompts in parts
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
        if self.prefix is not None and n > self.prefix.cache.block_tokens:
            return False
        return n <= self.batch_tokens and (not self.chunk_tokens or n <= self.chunk_tokens)

    def _run(self) -> None:
        while True:
            busy = bool(self._waiting)
            try:
                job = self._queue.get(block=not busy, timeout=None if busy or self.prefix is None else SWEEP_S)
                while True:
                    if job is None:
                        return
                    self._enqueue(job)
                    job = self._queue.get_nowait()
            except queue.Empty:
                if not busy and self.prefix is not None:
                    self.prefix.sweep()  # idle: expired prefixes go now, not at the next prompt
                    continue
            first = next(self._waiting.ordered(self._short_enough), None)
            if first is not None:
                self._run_batch(self._take_batch(first))
            long = next(self._waiting.ordered(lambda j: not self._short_enough(j)), None)
            if long is not None:
                self._advance(long)

    def _enqueue(self, job: PrefillJob) -> None:
        try:  # a bad prompt fails alone, before it can join a batch
            job.token_ids = self.engine.check_prompt(job.token_ids)
        except PrfaasError as exc:
            self._done(job, None, 0.0, exc)
            return
        self._waiting.push(job, job.cluster, len(job.token_ids))

    def _take_batch(self, first: PrefillJob) -> list[PrefillJob]:
        """``first`` and the short jobs after it in fair order that fit the bounds together (a job that does not
        fit waits for a later batch)."""
        batch, width = [first], len(first.token_ids)
        for job in self._waiting.ordered(self._short_enough):
            if len(batch) >= self.max_batch:
                break
            if job is not first and max(width, len(job.token_ids)) * (len(batch) + 1) <= self.batch_tokens:
                batch.append(job)
                width = max(width, len(job.token_ids))
        for job in batch:
            self._take(job)
        return batch

    def _take(self, job: PrefillJob) -> None:
        """``job`` leaves the queue for the engine now."""
        self._waiting.take(job)
        job.started = time.perf_counter()

    def _passes(self, job: PrefillJob) -> Iterator[ChunkResult | None]:
        """The long ``job``'s chunked prefill (started on its first pass), each pass sized by ``_next_pass``."""
        work = self._parts.get(id(job))
        if work is None:
            job.started = time.perf_counter()
            plan: ChunkPlan = functools.partial(self._next_pass, job)
            if self.prefix is not None:
                work = self.prefix.chunks(job.token_ids, job.tenant, plan, job.sampling, on_layer=job.on_layer)
            else:
                work = self.engine.prefill_chunks(job.token_ids, plan, job.sampling, on_layer=job.on_layer)
            self._parts[id(job)] = work
        return work

    def _next_pass(self, job: PrefillJob, done: int) -> int:
        """The tokens of ``job``'s pass starting now, after ``done``: the rest (0) when nothing else waits, else one
        chunk, so the fair order can switch after it."""
        alone = len(self._waiting) == 1 and self._queue.empty()
        size = 0 if alone or not self.chunk_tokens else self.chunk_tokens
        self._waiting.serve(job)
        return size

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

    def _advance(self, job: PrefillJob) -> None:
        """One pass of the long ``job``; at its last, it leaves the queue and finishes."""
        try:
            result = next(self._passes(job))
        except Exception as exc:
            self._end_parts(job)
            self._done(job, None, 0.0, exc)
            return
        if result is not None:
            self._end_parts(job)
            _, token, seconds = result
            self._done(job, token, seconds, None)

    def _end_parts(self, job: PrefillJob) -> None:
        self._parts.pop(id(job), None)
        self._waiting.take(job)

    def _done(self, job: PrefillJob, token: int | None, seconds: float, error: BaseException | None) -> None:
        self._depth.add(-1)
        if error is not None and not isinstance(error, PrfaasError):
            log.error("prefill failed: %s", error)
        job.finish(token, seconds, error)
