"""prfaas.bench.cores: the halves, the CPU list vLLM takes, and pinning a real process tree."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from prfaas.bench.cores import CoreSplit, pin

CORES = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CORES) < 2, reason="this process may run on fewer than 2 cores")


@needs_two
def test_the_halves_cover_this_process_cores_once_and_engines_take_the_first() -> None:
    split = CoreSplit.halves()
    assert split.engines | split.rest == set(CORES) and not split.engines & split.rest
    assert max(split.engines) < min(split.rest)
    assert split.threads == len(CORES) // 2 and split.env() == {"OMP_NUM_THREADS": str(len(CORES) // 2)}
    assert split.json() == {"engines": sorted(split.engines), "rest": sorted(split.rest), "threads": split.threads}


def test_one_core_cannot_be_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {3})
    with pytest.raises(ValueError, match="at least 2"):
        CoreSplit.halves()


def test_the_cpu_list_is_a_range_where_contiguous() -> None:
    assert CoreSplit(frozenset({0, 1, 2, 3}), frozenset({4})).cpu_list() == "0-3"
    assert CoreSplit(frozenset({0, 2, 5}), frozenset({1})).cpu_list() == "0,2,5"
    assert CoreSplit(frozenset({7}), frozenset({1})).cpu_list() == "7-7"


@needs_two
def test_place_pins_every_thread_of_a_tree_by_its_command_line() -> None:
    split = CoreSplit(frozenset(CORES[:1]), frozenset(CORES[1:]))
    # a parent with a second thread, and a child started before the placing
    script = ("import subprocess, threading, time; child = subprocess.Popen(['sleep', '60']); "
              "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); print('up', flush=True); "
              "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "up"
        split.place(parent.pid, lambda command: command[:1] == ["sleep"])
        tasks = os.listdir(f"/proc/{parent.pid}/task")
        assert len(tasks) >= 2 and all(os.sched_getaffinity(int(t)) == split.rest for t in tasks)
        children = _children(parent.pid)  # started before the parent said "up"
        assert children and all(os.sched_getaffinity(c) == split.engines for c in children)
        pin(parent.pid, frozenset(CORES))
        assert all(os.sched_getaffinity(int(t)) == set(CORES) for t in os.listdir(f"/proc/{parent.pid}/task"))
    finally:
        for child in _children(parent.pid):
            os.kill(child, 9)
        parent.kill()
        parent.wait(timeout=10)


def _children(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children()]
