"""Graceful drain with real processes: SIGTERM (or `prfaas admin drain`) under load loses no request; a second
SIGTERM forces the exit."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
from typer.testing import CliRunner

from prfaas.cli import app
from tests.services.deploy import deployment
from tests.services.test_faults import MODEL, complete, instances, pid_of


def _load(url: str, n: int, max_tokens: int, results: list[httpx.Response]) -> list[threading.Thread]:
    threads = [threading.Thread(target=lambda i=i: results.append(
        complete(url, list(range(100 + i, 160 + i)), max_tokens=max_tokens, ignore_eos=True))) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _gone(pid: int, timeout: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return time.monotonic() - started
        time.sleep(0.05)
    return None


def test_drain_each_role_under_load_loses_nothing() -> None:
    with deployment(MODEL, "relay", threshold=0, extra=("--decode", "2", "--prefill", "2")) as (url, _):
        results: list[httpx.Response] = []
        threads = _load(url, 6, 200, results)
        time.sleep(1.0)
        pids = {name: pid_of(url, name) for name in ("decode-0", "prefill-0")}
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)
        more = _load(url, 4, 20, results)  # new work keeps arriving while they drain
        for t in threads + more:
            t.join(120)
        assert [r.status_code for r in results] == [200] * 10, [r.text[:200] for r in results if r.status_code != 200]
        assert all(r.json()["prfaas"]["retries"] == 0 for r in results)  # finished where they were, not resumed
        for name, pid in pids.items():
            assert _gone(pid, 30) is not None, f"{name} did not exit after draining"
        left = {i["instance_id"] for i in instances(url)}
        assert not left & set(pids), left
        after = complete(url, "after the drain")
        assert after.status_code == 200, after.text


def test_admin_drain_of_the_relay_waits_for_its_blobs() -> None:
    with deployment(MODEL, "relay", threshold=0) as (url, _):
        pid = pid_of(url, "relay-0")
        result = CliRunner().invoke(app, ["admin", "drain", "relay-0", "--router", url, "--timeout", "60s"])
        assert result.exit_code == 0, result.output
        assert "drained and gone" in result.output
        assert _gone(pid, 10) is not None


def test_second_sigterm_forces_exit() -> None:
    with deployment(MODEL, "direct", threshold=0, extra=("--decode", "2")) as (url, _):
        results: list[httpx.Response] = []
        threads = _load(url, 1, 3000, results)  # far longer than the test waits
        deadline = time.monotonic() + 30
        busy: dict[str, Any] = {}
        while not busy and time.monotonic() < deadline:
            live = [httpx.get(f"{i['url']}/health").json() for i in instances(url) if i["role"] == "decode"]
            busy = next((i for i in live if i["queue_depth"] > 0), {})
            time.sleep(0.05)
        os.kill(busy["pid"], signal.SIGTERM)
        time.sleep(1.5)
        assert _gone(busy["pid"], 0.1) is None, "the first SIGTERM must drain, not exit"
        assert httpx.get(f"{busy['url']}/ready").status_code == 503
        os.kill(busy["pid"], signal.SIGTERM)
        took = _gone(busy["pid"], 15)
        assert took is not None and took < 15
        for t in threads:
            t.join(180)
        assert results[0].status_code == 200  # the router resumed the cut stream on the other decode instance
        assert results[0].json()["prfaas"]["retries"] >= 1
