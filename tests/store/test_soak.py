"""Soak (bounded): a few hundred requests through ``prfaas up`` (relay mode, a tiny model, every prompt offloaded)
with random client disconnects. At the end: zero live blobs, one deletion record per created blob in every store,
every audit chain verifies with no blob left open, and the relay's memory stays flat."""

from __future__ import annotations

import concurrent.futures
import random
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from prfaas.audit import verify
from tests.services.deploy import deployment

REQUESTS, CONCURRENCY, WARM_UP = 240, 8, 16
RSS_GROWTH_LIMIT = 64 << 20
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "near", "a", "river", "bank", "while",
         "rain", "falls"]


def body(rng: random.Random, stream: bool) -> dict[str, Any]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(20, 120)))
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": rng.randrange(2, 12), "temperature": 0,
            "stream": stream}


def one_request(url: str, seed: int) -> str:
    """A request that finishes, or a client that goes away at a random point; returns which."""
    rng = random.Random(seed)
    how = rng.choice(["full", "full", "plain", "after_first", "mid_stream", "hang_up"])
    try:
        if how == "plain":
            httpx.post(f"{url}/v1/completions", json=body(rng, False), timeout=60).raise_for_status()
        elif how == "hang_up":
            hang_up(url, body(rng, True))
        else:
            with httpx.stream("POST", f"{url}/v1/completions", json=body(rng, True), timeout=60) as reply:
                for n, _ in enumerate(reply.iter_lines()):
                    if (how == "after_first" and n >= 0) or (how == "mid_stream" and n >= 3):
                        break
    except httpx.HTTPError as exc:
        return f"error {type(exc).__name__}"
    return how


def hang_up(url: str, payload: dict[str, Any]) -> None:
    """Send the request and close the socket before any answer (the client vanished)."""
    host, port = url.removeprefix("http://").split(":")
    data = httpx.Request("POST", f"{url}/v1/completions", json=payload)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall((head + f"Content-Length: {len(data.content)}\r\n\r\n").encode() + data.content)


def relay_rss(url: str) -> int:
    relay = next(i for i in httpx.get(f"{url}/admin/instances").json() if i["role"] == "relay")
    pid = httpx.get(f"{relay['url']}/health").json()["pid"]
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


def live_blobs(url: str) -> int:
    return sum(report["store"]["blobs"] for report in httpx.get(f"{url}/admin/kv").json().values())


def test_soak_with_client_disconnects(tmp_path: Path) -> None:
    config = tmp_path / "prfaas.yaml"
    config.write_text(f"kv_ttl_seconds: 60\naudit_log: {tmp_path}/audit/{{instance}}.jsonl\n"
                      "degrade_p99_ms: 100000\n")  # 2 busy cores must not make the router keep prompts local
    with deployment("tiny-llama", "relay", threshold=0, extra=("--config", str(config))) as (url, _):
        for seed in range(WARM_UP):
            one_request(url, -1 - seed)
        rss_before = relay_rss(url)
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
            outcomes = list(pool.map(lambda s: one_request(url, s), range(REQUESTS)))
        soak_s = time.monotonic() - started
        deadline = time.monotonic() + 75  # a blob nobody releases ends by its TTL (60 s)
        while live_blobs(url) and time.monotonic() < deadline:
            time.sleep(0.5)
        stores = httpx.get(f"{url}/admin/kv").json()
        rss_after = relay_rss(url)
    ended = [r for report in stores.values() for r in report["records"]]
    reasons = {reason: sum(r["reason"] == reason for r in ended) for reason in {r["reason"] for r in ended}}
    print(f"\nsoak: {REQUESTS} requests in {soak_s:.1f} s, outcomes "
          f"{ {o: outcomes.count(o) for o in set(outcomes)} }, blobs ended {reasons}, relay RSS "
          f"{rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB")
    assert all(report["store"]["blobs"] == 0 for report in stores.values()), stores
    assert not [o for o in outcomes if o.startswith("error")], outcomes
    logs = sorted((tmp_path / "audit").glob("*.jsonl"))
    assert logs, "no audit log written"
    for log in logs:
        verdict = verify(log)
        print(f"audit {log.name}: ok={verdict.ok} entries={verdict.entries} created={verdict.created} "
              f"ended={dict(verdict.ended)} open={len(verdict.open_blobs)} clean_close={verdict.clean_close}")
        assert verdict.ok, verdict.error
        assert verdict.open_blobs == [] and verdict.clean_close
        assert sum(verdict.ended.values()) == verdict.created  # one deletion entry per created blob
    relay_log = next(v for v in map(verify, logs) if v.created)
    assert relay_log.created >= REQUESTS // 2  # every request that reached prefill made one blob
    assert rss_after - rss_before < RSS_GROWTH_LIMIT, (rss_before, rss_after)
