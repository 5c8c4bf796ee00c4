"""The router drains itself: SIGTERM (or `prfaas admin drain-router`, with the API key where the router has keys)
refuses new requests with 503 KV_UNAVAILABLE and Retry-After, turns /health 503, lets open streams finish, then
exits. `prfaas admin` sends the key (--api-key or $PRFAAS_API_KEY) and never prints it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from typer.testing import CliRunner

from prfaas.cli import app
from tests.services.deploy import alive, deployment, descendants
from tests.services.test_faults import MODEL

KEY = "prfaas-test-key-" + "7" * 24
TOKENS = 400


class Stream(threading.Thread):
    """One streaming completion; records when each text chunk arrived and how the stream ended."""

    def __init__(self, url: str, prompt: list[int], headers: dict[str, str] | None = None) -> None:
        super().__init__()
        self.url, self.prompt, self.headers = url, prompt, headers or {}
        self.chunks: list[float] = []
        self.finish: str | None = None
        self.done = False

    def run(self) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=self.headers,
                          timeout=120) as reply:
            for line in reply.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    self.chunks.append(time.monotonic())
                    self.finish = choices[0].get("finish_reason") or self.finish


def _start(url: str, n: int, headers: dict[str, str] | None = None) -> list[Stream]:
    streams = [Stream(url, list(range(200 + i, 240 + i)), headers) for i in range(n)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 60
    while any(len(s.chunks) < 3 for s in streams):
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.02)
    return streams


def _router_pid(up_pid: int) -> int:
    for pid in descendants(up_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"\0router\0" in f.read():
                return pid
    raise AssertionError("no router process")


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def _finished(streams: list[Stream], after: float) -> None:
    for s in streams:
        s.join(120)
        assert s.done and s.finish == "length", (s.done, s.finish)
        assert s.chunks[-1] > after  # it kept streaming after the drain began


def test_sigterm_drains_the_router() -> None:
    with deployment(MODEL, "direct", threshold=0) as (url, up):
        streams = _start(url, 2)
        router = _router_pid(up.pid)
        os.kill(router, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after SIGTERM"
            time.sleep(0.02)
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2})
        began = time.monotonic()
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "KV_UNAVAILABLE", refused.text
        assert "draining" in refused.json()["error"]["message"] and refused.headers["retry-after"]
        _finished(streams, began)
        assert _gone(router, 30), "the router did not exit after draining"


def _keyed_config(tmp_path: Path) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"api_keys": [{"name": "ops", "key": KEY}]}))
    path.chmod(0o600)
    return str(path)


def _admin(*args: str, env: dict[str, Any] | None = None) -> Any:
    return CliRunner().invoke(app, ["admin", *args], env=env)


def test_admin_sends_the_key_and_drains_the_router(tmp_path: Path) -> None:
    with deployment(MODEL, "direct", threshold=0, extra=("--config", _keyed_config(tmp_path))) as (url, up):
        without = _admin("check", "--router", url, env={"PRFAAS_API_KEY": ""})
        assert without.exit_code == 2 and "HTTP 401" in without.output and "--api-key" in without.output
        wrong = _admin("check", "--router", url, "--api-key", "not-the-key-" + "0" * 20)
        assert wrong.exit_code == 2 and "not-the-key" not in wrong.output
        flag = _admin("check", "--router", url, "--api-key", KEY)
        assert flag.exit_code == 0 and "0 problem(s)" in flag.output, flag.output
        env = _admin("check", "--router", url, env={"PRFAAS_API_KEY": KEY})
        assert env.exit_code == 0, env.output
        router = _router_pid(up.pid)
        streams = _start(url, 1, {"Authorization": f"Bearer {KEY}"})
        began = time.monotonic()
        drained = _admin("drain-router", "--router", url, "--timeout", "60s", env={"PRFAAS_API_KEY": KEY})
        assert drained.exit_code == 0 and "drained and gone" in drained.output, drained.output
        assert "1 requests open" in drained.output
        _finished(streams, began)
        assert KEY not in without.output + flag.output + env.output + drained.output
        assert _gone(router, 10)
