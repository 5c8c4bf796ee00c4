"""Scheduler behaviour with real processes: dead decode mid-stream, dead prefill, full decode memory, another
model registering, the rate limit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.conftest import get_engine
from tests.services.deploy import deployment

MODEL = "tiny-llama"


def config_file(tmp_path: Path, **values: Any) -> str:
    path = tmp_path / "prfaas.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def instances(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/admin/instances").json()


def pid_of(url: str, instance_id: str) -> int:
    info = next(i for i in instances(url) if i["instance_id"] == instance_id)
    return int(httpx.get(f"{info['url']}/health").json()["pid"])


def complete(url: str, prompt: str | list[int], max_tokens: int = 8, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_decode_dies_mid_stream_and_another_continues(tmp_path: Path) -> None:
    prompt = list(range(100, 140))
    with deployment(MODEL, "direct", threshold=0, extra=("--decode", "2")) as (url, _):
        pieces: list[str] = []
        final: dict[str, Any] = {}

        def stream() -> None:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2000, "temperature": 0, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            pieces.append(chunk["choices"][0]["text"])
                        final.update(chunk)

        thread = threading.Thread(target=stream)
        thread.start()
        while len(pieces) < 20:
            time.sleep(0.01)
        live = [httpx.get(f"{i['url']}/health").json() for i in instances(url) if i["role"] == "decode"]
        busy = max(live, key=lambda i: i["queue_depth"])  # the instance's own, live figure
        assert busy["queue_depth"] == 1
        os.kill(busy["pid"], signal.SIGKILL)
        thread.join(120)
        assert "prfaas" in final, final
        extension = final["prfaas"]
        assert extension["retries"] >= 1 and extension["resumed_on"] != busy["instance_id"]
        assert final["choices"][0]["finish_reason"] == "length"
        engine = get_engine(MODEL)
        streamed = engine.tokenizer.encode("".join(pieces), add_special_tokens=False)
        reference = engine.tokenizer.decode(engine.generate(prompt, 20))
        assert len(streamed) >= 1500  # continued well past the kill, with no gap and nothing repeated at the seam
        assert streamed[:15] == engine.tokenizer.encode(reference, add_special_tokens=False)[:15]


def test_prefill_gone_falls_back_or_fails_cleanly(tmp_path: Path) -> None:
    with deployment(MODEL, "relay", threshold=0) as (url, _):
        os.kill(pid_of(url, "prefill-0"), signal.SIGKILL)  # no deregistration: the router still believes in it
        reply = complete(url, "hello there")
        assert reply.status_code == 200
        extension = reply.json()["prfaas"]
        assert extension["route"] == "local" and extension["fallback"] is True
        assert "KV_UNAVAILABLE" in extension["reason"] or "prefill" in extension["reason"]
    strict = config_file(tmp_path, fallback_local_prefill=False)
    with deployment(MODEL, "relay", threshold=0, extra=("--config", strict)) as (url, _):
        os.kill(pid_of(url, "prefill-0"), signal.SIGTERM)  # deregisters: no prefill instance at all
        deadline = time.monotonic() + 30
        while any(i["role"] == "prefill" for i in instances(url)) and time.monotonic() < deadline:
            time.sleep(0.1)
        reply = complete(url, "hello there")
        assert reply.status_code == 503
        assert "fallback_local_prefill is off" in reply.json()["error"]["message"]
        assert reply.headers["retry-after"]


def test_full_decode_memory_queues_then_serves_or_refuses(tmp_path: Path) -> None:
    # tiny-llama holds 512 bytes of KV per token: a 1 MiB decode budget fits about 2,000 tokens.
    small = config_file(tmp_path, store_budget_mb=1, decode_queue_timeout_ms=60000)
    with deployment(MODEL, "direct", threshold=100000, extra=("--config", small)) as (url, _):
        too_big = complete(url, "hi", max_tokens=5000)
        assert too_big.status_code == 503
        assert "more than any decode instance holds" in too_big.json()["error"]["message"]
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: results.append(complete(url, "hi", max_tokens=1200)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [r.status_code for r in results] == [200, 200]


def test_another_model_is_refused_at_registration() -> None:
    with deployment(MODEL, "direct", threshold=0) as (url, _):
        other = subprocess.Popen([sys.executable, "-m", "prfaas", "serve", "decode", "--router", url, "--model",
                                  "tiny-lfm2", "--instance-id", "intruder"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        try:
            _, err = other.communicate(timeout=120)
        finally:
            if other.poll() is None:
                other.kill()
        assert "refused" in err and "weights" in err
        assert "intruder" not in {i["instance_id"] for i in instances(url)}
        metrics = httpx.get(f"{url}/metrics").text
        assert 'prfaas_registry_refused_total{reason="fingerprint"} 1.0' in metrics


def test_rate_limit_answers_429(tmp_path: Path) -> None:
    limited = config_file(tmp_path, rate_limit_qps=0.2)
    with deployment(MODEL, "direct", threshold=100000, extra=("--config", limited)) as (url, _):
        assert complete(url, "one").status_code == 200
        refused = complete(url, "two")
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "RATE_LIMITED"


def test_relay_killed_under_load_requests_fall_back(tmp_path: Path) -> None:
    """A store process (the relay) dies while requests run: every request still completes (a remote prefill that
    fails before the first token falls back to local prefill), and new requests keep working without it (so
    ``prfaas up`` must not restart it: tests/services/test_supervisor.py covers the restart)."""
    with deployment(MODEL, "relay", threshold=0, extra=("--max-restarts", "0")) as (url, _):
        results: list[httpx.Response] = []

        def burst(n: int) -> None:
            threads = [threading.Thread(target=lambda: results.append(complete(url, list(range(10, 3000)))))
                       for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)

        burst(2)
        loader = threading.Thread(target=burst, args=(6,))
        loader.start()
        time.sleep(0.2)
        os.kill(pid_of(url, "relay-0"), signal.SIGKILL)
        loader.join(180)
        burst(2)
        assert len(results) == 10 and all(r.status_code == 200 for r in results), [r.text for r in results]
        routes = [r.json()["prfaas"] for r in results]
        assert all(e["route"] == "local" for e in routes[-2:])  # after the relay died: fallback, or no relay
        assert any(e["route"] == "remote" for e in routes[:2])  # before it died
