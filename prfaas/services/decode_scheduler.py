"""The decode instance's engine loop on one thread, fed from the event loop: continuous batching.

Each iteration: admit waiting sequences while the batch has room (a restore from transferred KV, or one chunk of a
local prefill, so a long prompt never blocks running sequences for more than one chunk), then one decode step over
every running sequence. Where the engine ``folds``, a chunk's forward pass carries the running sequences' step (one
pass reads the weights once for both) and the separate step is skipped. Tokens go back to each request's asyncio
queue; a request that is cancelled (client gone, stop string seen) leaves the batch at the next step and frees its
slot. With nothing to do the thread sleeps on a queue (no busy-waiting).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prfaas.engine.batch import DecodeBatch, Row
from prfaas.errors import PrfaasError
from prfaas.messages import SamplingParams
from prfaas.services.counter import Counter

if TYPE_CHECKING:  # the protocol's name only: importing prfaas.engine at run time loads torch
    from prfaas.engine.protocol import Engine

log = logging.getLogger("prfaas.decode_scheduler")
Prepared = tuple[Any, int, int, dict[str, float]]  # cache, first token, length, stage timings


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


def _deliver(events: list[tuple[Sequence, tuple[Any, ...]]]) -> None:
    """On the event loop: a step's events, in order."""
    for seq, event in events:
        seq.out.put_nowait(event)


class DecodeScheduler:
    """The decode instance's engine loop (see the module docstring). ``submit`` from the event loop; everything
    else runs on its own thread, which owns the ``DecodeBatch``."""

    def __init__(self, engine: Engine, max_batch: int, idle: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.batch = DecodeBatch(engine, max_batch)
        self._idle = idle  # run on the engine thread while nothing is running or waiting (a prefix cache's sweep)
        self._waiting: queue.Queue[Sequence | None] = queue.Queue()
        self._preparing: tuple[Sequence, Iterator[Prepared | None]] | None = None
        self._running: dict[str, Sequence] = {}
        self._waiting_count = Counter()
        self._thread = threading.Thread(target=self._run, name="prfaas-decode", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        self._waiting_count.add(1)
        self._waiting.put(seq)

    def local_chunk(self, chunk_tokens: int) -> int:
        """On the engine thread: the pass size of a local prompt's prefill starting now. Chunks exist so that running
        sequences step between them. With none running there is nothing to interleave (admission is one sequence at
        a time, so none joins before this prefill ends), and every pass more costs its own walk through the model:
        one pass (0)."""
        return chunk_tokens if len(self.batch) else 0

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
            self.batch.stepped = None
            if not self._admit():
                return
            if self.batch.stepped is not None:  # a prefill pass carried the step
                self._emit(self.batch.stepped)
            elif len(self.batch):
                self._step()

    def _admit(self) -> bool:
        """Advance admission by one unit of work; False when the loop must stop."""
        if self._preparing is None and not self.batch.full:
            idle = not len(self.batch)
            try:
                seq = self._waiting.get(block=idle, timeout=0.5 if idle else None)
            except queue.Empty:
                if idle and self._idle is not None:
                    self._idle()
                return True
            if seq is None:
                return False
            self._waiting_count.add(-1)
            self._preparing = (seq, seq.prepare())
        if self._preparing is not None:
            self._prepare_one_chunk(*self._preparing)
        return True

    def _prepare_one_chunk(self, seq: Sequence, work: Iterator[Prepared | None]) -> None:
        if self.engine.folds:
            self._drop_cancelled()
            self.engine.carry(self.batch if len(self.batch) else None)
        try:
            result = next(work)
        except Exception as exc:  # the request fails alone; the loop and the batch go on
            self._preparing = None
            seq.emit("error", exc if isinstance(exc, PrfaasError) else RuntimeError(str(exc)))
            if not isinstance(exc, PrfaasError):
                log.exception("preparing %s failed", seq.seq_id)
            return
        finally:
            self.engine.carry(None)  # a chunk without a forward pass (a restore) left the rows to their own step
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

    def _drop_cancelled(self) -> None:
        for seq in list(self._running.values()):
            if seq.cancelled.is_set():
                self._finish(seq, "cancelled")

    def _step(self) -> None:
        self._drop_cancelled()
        if len(self.batch):
            self._emit(self.batch.step())

    def _emit(self, tokens: dict[str, int]) -> None:
        """A step's tokens, handed to each event loop in one call (one wake-up a step, not one a token: the loop's
        thread shares the GIL and the cores with this one)."""
        events: dict[asyncio.AbstractEventLoop, list[tuple[Sequence, tuple[Any, ...]]]] = {}
        for seq_id, token in tokens.items():
            seq = self._running[seq_id]
            seq.produced += 1
            out = events.setdefault(seq.loop, [])
            out.append((seq, ("token", token, {})))
            reason = "stop" if token in seq.eos else "length" if seq.produced >= seq.max_new else None
            if reason:
                self._leave(seq)
                out.append((seq, ("end", reason)))
        for loop, batch in events.items():
            loop.call_soon_threadsafe(_deliver, batch)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._leave(seq)
        seq.emit("end", reason)

    def _leave(self, seq: Sequence) -> None:
        self.batch.remove(seq.seq_id)
        del self._running[seq.seq_id]
