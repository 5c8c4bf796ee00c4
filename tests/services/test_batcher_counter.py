"""The engine loops' counters are changed from the event loop and the engine thread at once: no update is lost."""

from __future__ import annotations

import sys
import threading

from prfaas.services.counter import Counter


def test_counter_changed_from_two_threads_loses_no_update() -> None:
    counter, rounds = Counter(), 100_000
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, where a plain += would lose updates
    try:
        threads = [threading.Thread(target=lambda d=d: [counter.add(d) for _ in range(rounds)]) for d in (1, -1, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        sys.setswitchinterval(interval)
    assert counter.value == rounds
