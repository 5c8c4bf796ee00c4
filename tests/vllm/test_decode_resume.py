"""A decode's vLLM server killed right after the client got its first token, through prfaas's router, on one real
deployment: ``prfaas up --engine vllm --mode direct --decode 2 --offload-threshold 0`` (SmolLM2-135M fp32).

On the remote route a vLLM decode instance streams the first token prefill sampled before its own vLLM runs, so
the client has a token when that server dies. The router resumes the request on the other decode instance from
the prompt plus the tokens already streamed: the client gets the greedy text of vLLM alone, without an error or a
repeated token; the ``prfaas`` field names the instance that resumed it; the dead server's instance stops (exit 1)
and ``prfaas up`` restarts it; no blob is left in the producer's store, no process of the deployment is left.

Skips only where vLLM's CPU build is not installed (``make vllm``). About 4-8 minutes on 2 shared cores (three
vLLM servers start).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from prfaas.transfer import client
from tests.services.deploy import alive, deployment, descendants, line_saying
from tests.vllm.servers import EAGER, NEEDS_VLLM, deployed_servers

MODEL = "smollm2-135m"
MAX_TOKENS = 24
REQUEST_S = 300.0  # httpx's bound on one request: never reached unless something hangs
FIND_S = 5.0  # how long the test looks for the decode server that holds the request
HEAL_S = 180.0  # the killed server's instance exited and was restarted
PROMPT = " ".join(f"The number {i} is followed by {i + 1}." for i in range(30))  # about 340 tokens

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    NEEDS_VLLM,
]


@dataclass
class Up:
    url: str
    proc: Any
    decodes: dict[int, int]  # vLLM server pid → its port, for the decode instances' servers
    reference: str  # vLLM alone's greedy text of the prompt


@dataclass
class Streamed:
    text: str = ""
    extension: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    killed: int = 0  # the decode vLLM server killed after the first token


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    left: list[int] = []
    with deployment(MODEL, "direct", threshold=0,
                    extra=("--engine", "vllm", "--dtype", "float32", "--decode", "2"), env=EAGER) as (url, proc):
        decodes = deployed_servers(proc.pid, "kv_consumer")
        assert len(decodes) == 2, decodes
        yield Up(url, proc, decodes, _reference(next(iter(decodes.values()))))
        left = descendants(proc.pid)  # the restarted instance and its server included
    deadline = time.monotonic() + 30
    while (alive_left := [p for p in left if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive_left, f"processes left behind: {alive_left}"


def _vllm_post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(f"http://127.0.0.1:{port}{path}", json={"model": MODEL, **body}, timeout=REQUEST_S)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def _reference(port: int) -> str:
    """vLLM alone on the token ids the decode instance gives the router for this prompt."""
    ids = _vllm_post(port, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})["tokens"]
    answer = _vllm_post(port, "/v1/completions", {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0})
    return str(answer["choices"][0]["text"])


def _busy(port: int) -> bool:
    """Whether the vLLM server on ``port`` holds a request (running, or waiting for its KV)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return False
    gauges = ("vllm:num_requests_running{", "vllm:num_requests_waiting{")
    return any(float(line.rsplit(" ", 1)[1]) > 0 for line in text.splitlines() if line.startswith(gauges))


def _kill_the_busy_decode(up: Up) -> int:
    deadline = time.monotonic() + FIND_S
    while time.monotonic() < deadline:
        for pid, port in up.decodes.items():
            if _busy(port):
                os.kill(pid, signal.SIGKILL)
                return pid
        time.sleep(0.01)
    raise AssertionError(f"no decode vLLM server held the request within {FIND_S} s of its first token")


def _ask_and_kill(up: Up) -> Streamed:
    """A streaming completion through the router; the decode server holding it killed at its first token."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    out = Streamed()
    with httpx.stream("POST", f"{up.url}/v1/completions", json=body, timeout=REQUEST_S) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            out.error = chunk.get("error", out.error)
            out.text += "".join(c.get("text") or "" for c in chunk.get("choices", []))
            out.extension = chunk.get("prfaas", out.extension)
            if out.text and not out.killed:
                out.killed = _kill_the_busy_decode(up)
    return out


def _producer_blobs(up: Up) -> int:
    instances = httpx.get(f"{up.url}/admin/instances", timeout=30).json()
    address = next(i["kv_address"] for i in instances if i["role"] == "prefill")
    return int(asyncio.run(client.stat(address, timeout_s=10))["blobs"])


def test_a_decode_vllm_killed_after_the_first_token_is_resumed_elsewhere(up: Up) -> None:
    engines = {pid: [pid, *descendants(pid)] for pid in up.decodes}
    started = time.monotonic()
    out = _ask_and_kill(up)
    print(f"\n  -> {time.monotonic() - started:.1f} s, killed {out.killed}, prfaas {out.extension}, error {out.error}")
    assert out.error is None and out.text == up.reference, out
    meta = out.extension
    assert meta["route"] == "remote" and meta["retries"] >= 1, meta
    assert meta["resumed_on"] and meta["resumed_on"] != meta["decode_instance"], meta
    line = line_saying(up.proc, f"decode {meta['decode_instance']} exited with code 1", HEAL_S)
    assert "restarting" in line, line
    deadline = time.monotonic() + 30
    while left := [p for p in engines[out.killed] if alive(p)]:
        assert time.monotonic() < deadline, f"the dead vLLM server left processes behind: {left}"
        time.sleep(0.2)
    deadline = time.monotonic() + 30  # releases are asynchronous
    while _producer_blobs(up) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _producer_blobs(up) == 0, "a blob was left in the producer's store"
