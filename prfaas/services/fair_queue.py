"""Weighted fair queueing across client clusters, by prompt tokens: the order of a prefill instance's queue.

Weighted fair queueing by finish tags (Demers, Keshav and Shenker, 1989; virtual time as in start-time fair
queueing, Goyal et al., 1996): a job of ``n`` prompt tokens from cluster ``c`` with share ``w`` gets the finish tag
``F_c = max(F_c + n / w, V)`` (``F_c`` on the right: the cluster's last finish tag) and the start tag
``S = F_c - n / w``, where ``V`` is the start tag of the job last put into service. Jobs are served by (priority
class, highest first; finish tag; arrival). So a cluster that sends ten times its share only lengthens its own
queue: another cluster's next job is tagged from ``V``, not from behind the burst, and goes ahead of the burst's
later jobs. A cluster behind the virtual time (under its share) keeps that lag as credit, up to one prompt: once
it lags by the prompt's ``n / w``, its next prompt's finish tag is ``V``, ahead of the job in service (whose finish
tag is not before ``V``; ties go by arrival); a longer idle spell banks no more than that, and its later
prompts are tagged as usual.
A long prompt is served in parts (``serve``: one forward pass of a chunked prefill each) and stays queued between
them, so a job ranked ahead of it — an under-share cluster's new prompt — takes the next pass and runs to its end,
then the rest follows. A cluster's own later jobs rank behind its earlier ones (their tags are past its finish
tag), so at most one job per cluster is in parts. Priority classes are strict: a lower class waits while a
higher one has work (use it for a cluster whose requests are interactive, not to share load).

Not thread-safe: the prefill engine thread owns it (``prfaas.services.prefill_scheduler``). Before that queue, the
instance's slots for blobs in flight are handed out in the same spirit (``FairSlots``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from prfaas.tenancy.clusters import ClusterPolicy

T = TypeVar("T")


@dataclass(order=True)
class _Tagged(Generic[T]):
    rank: tuple[int, float, int]  # (−priority, finish tag, arrival)
    start: float = field(compare=False)
    item: T = field(compare=False)


class FairQueue(Generic[T]):
    """Items tagged on ``push``, listed in service order by ``ordered``, served in parts by ``serve``, taken out by
    ``take``."""

    def __init__(self) -> None:
        self._items: list[_Tagged[T]] = []
        self._finish: dict[str, float] = {}
        self._vtime = 0.0
        self._arrivals = 0

    def push(self, item: T, cluster: ClusterPolicy, tokens: int) -> None:
        cost = max(1, tokens) / cluster.share
        finish = max(self._finish.get(cluster.name, 0.0) + cost, self._vtime)
        self._finish[cluster.name] = finish
        self._arrivals += 1
        self._items.append(_Tagged((-cluster.priority, finish, self._arrivals), finish - cost, item))
        self._items.sort()

    def ordered(self, keep: Callable[[T], bool] = lambda _: True) -> Iterator[T]:
        """The items ``keep`` accepts, in service order (a snapshot: ``take`` may be called while iterating)."""
        return iter([t.item for t in self._items if keep(t.item)])

    def serve(self, item: T) -> None:
        """A part of ``item`` goes into service: the virtual time moves to its start tag; it stays queued, in its
        rank, until ``take``."""
        self._vtime = max(self._vtime, self._find(item).start)

    def take(self, item: T) -> None:
        """``item`` leaves the queue (served whole now, or its last part done): the virtual time moves to its start
        tag."""
        tagged = self._find(item)
        self._items.remove(tagged)
        self._vtime = max(self._vtime, tagged.start)

    def _find(self, item: T) -> _Tagged[T]:
        return next(t for t in self._items if t.item is item)

    def __len__(self) -> int:
        return len(self._items)


class FairSlots:
    """``n`` slots shared by clusters (a prefill instance's blobs in flight, ``max_inflight_kv``): a slot that frees
    goes to the waiting cluster of the highest priority holding the fewest slots per unit of share, arrival order
    inside a cluster, so a burst of one cluster cannot hold every slot ahead of another cluster's prompt (which
    would queue it in arrival order before the fair queue sees it). Event-loop only."""

    def __init__(self, n: int) -> None:
        self.free = n
        self._held: dict[str, int] = {}
        self._waiting: dict[str, deque[tuple[asyncio.Future[None], ClusterPolicy]]] = {}

    @contextlib.asynccontextmanager
    async def slot(self, cluster: ClusterPolicy) -> AsyncIterator[None]:
        """Hold one slot for ``cluster`` while the block runs (waiting for one first when none is free)."""
        await self._acquire(cluster)
        try:
            yield
        finally:
            self._release(cluster)

    def held(self, name: str) -> int:
        return self._held.get(name, 0)

    async def _acquire(self, cluster: ClusterPolicy) -> None:
        if self.free > 0 and not any(self._waiting.values()):
            self._grant(cluster)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(cluster.name, deque())
        queue.append((waiter, cluster))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # granted, then cancelled before it ran: give it back
                self._release(cluster)
            else:
                with contextlib.suppress(ValueError):  # a wake-up may have dropped it already
                    queue.remove((waiter, cluster))
            raise

    def _grant(self, cluster: ClusterPolicy) -> None:
        self.free -= 1
        self._held[cluster.name] = self.held(cluster.name) + 1

    def _release(self, cluster: ClusterPolicy) -> None:
        self.free += 1
        self._held[cluster.name] = self.held(cluster.name) - 1
        self._wake()

    def _wake(self) -> None:
        while self.free > 0:
            ready = {name: queue[0][1] for name, queue in self._waiting.items() if queue}
            if not ready:
                return
            name = min(ready, key=lambda n: (-ready[n].priority, self.held(n) / ready[n].share))
            waiter, cluster = self._waiting[name].popleft()
            if not waiter.cancelled():
                self._grant(cluster)
                waiter.set_result(None)
