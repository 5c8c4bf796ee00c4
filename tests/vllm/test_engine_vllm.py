"""``prfaas up --engine vllm``: a whole deployment whose prefill and decode instances each run a real vLLM server
(the CPU build in ``.venv-vllm``, SmolLM2-135M fp32) as their engine, driven through prfaas's router.

One deployment per mode (relay, direct), every prompt over the offload threshold (0):
- completions and chat, streaming and not, greedy, take the remote route: ``prfaas.route == "remote"`` with the
  blob's ``kv_bytes > 0``, and the decode vLLM's metrics count the prompts as ``external_kv_transfer`` (every
  token of each), not recomputed: the first token is prefill's, streamed by the decode instance before its vLLM
  runs (``stages.decode_ms == 0``), and decode's vLLM computes one token (that one) before the second; a
  one-token answer never reaches decode's vLLM, and its blob is released; the connectors' ``TCP_INFO`` per peer
  reaches the router in the instances' heartbeats (``tcp_peers``) and the ``dc-a:dc-b`` link's RTT;
- then the prefill instance is drained through the router (``POST /admin/drain/prefill-0``): it exits with its
  vLLM server (no process of it left), and the same four requests take the local route (decode's vLLM prefills
  them itself) and give the same text, token for token;
- the decode instance's vLLM server killed (a crash): the instance stops, exits non-zero (``prfaas up`` says it
  restarts it) and nothing of the dead server is left;
- at the end ``prfaas up`` stops and leaves no process behind (``tests.services.deploy``).

Skips only where vLLM's CPU build is not installed (``make vllm``). About 2 minutes per mode on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from prfaas.transfer import client
from tests.services.deploy import alive, deployment, descendants, line_saying
from tests.vllm.servers import EAGER, NEEDS_VLLM

REQUEST_S = 120.0
DRAIN_S = 90.0
PROMPT = " ".join(f"The number {i} is followed by {i + 1}." for i in range(30))  # about 350 tokens: 3 blocks
MESSAGES = [{"role": "user", "content": "Count from 1 to 40, one number per line: " + PROMPT}]

pytestmark = [
    pytest.mark.slow,
    NEEDS_VLLM,
]


@pytest.fixture(scope="module", params=["relay", "direct"])
def up(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    with deployment("smollm2-135m", request.param, threshold=0,
                    extra=("--engine", "vllm", "--dtype", "float32"), env=EAGER) as (url, proc):
        yield url, proc


def _body(chat: bool, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "smollm2-135m", "max_tokens": 20, "temperature": 0, "stream": stream}
    return {**body, "messages": MESSAGES} if chat else {**body, "prompt": PROMPT}


def _ask(url: str, chat: bool, stream: bool, **extra: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(text, the ``prfaas`` field, usage) of one request through the router."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {**_body(chat, stream), **({"stream_options": {"include_usage": True}} if stream else {}), **extra}
    if not stream:
        reply = httpx.post(url + path, json=body, timeout=REQUEST_S)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        choice = data["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), data["prfaas"], data["usage"]
    text, extension, usage = "", {}, {}
    with httpx.stream("POST", url + path, json=body, timeout=REQUEST_S) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            for choice in chunk.get("choices", []):
                text += (choice.get("delta", {}).get("content") if chat else choice.get("text")) or ""
            extension, usage = chunk.get("prfaas", extension), chunk.get("usage") or usage
    return text, extension, usage


KINDS = [(chat, stream) for chat in (False, True) for stream in (False, True)]


def _processes(proc: Any) -> Iterator[tuple[int, list[str]]]:
    """(pid, command line) of each of ``prfaas up``'s descendants."""
    for pid in descendants(proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                yield pid, f.read().decode(errors="replace").split("\0")
        except OSError:
            continue


def _vllm_server(proc: Any, kv_role: str) -> tuple[int, int] | None:
    """(pid, port) of the vLLM server in ``kv_role`` (None: none running)."""
    for pid, args in _processes(proc):
        if "prfaas.vllm.launch" in args and any(kv_role in a for a in args):
            return pid, int(args[args.index("--port") + 1])
    return None


def _vllm_port(proc: Any, kv_role: str) -> int | None:
    server = _vllm_server(proc, kv_role)
    return server[1] if server else None


def _instance(proc: Any, role: str) -> int | None:
    """The pid of ``prfaas serve ROLE``."""
    return next((pid for pid, args in _processes(proc) if args[2:5] == ["prfaas", "serve", role]), None)


def _prompt_sources(port: int) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            found[line.split('source="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return found


def _drain_prefill(url: str, proc: Any) -> None:
    reply = httpx.post(f"{url}/admin/drain/prefill-0", timeout=30)
    assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + DRAIN_S
    while _vllm_port(proc, "kv_producer") is not None:
        assert time.monotonic() < deadline, "the drained prefill instance left its vLLM server running"
        time.sleep(0.5)


def test_remote_route_equals_local_route(up: tuple[str, Any]) -> None:
    url, proc = up
    decode_port = _vllm_port(proc, "kv_consumer")
    assert decode_port is not None
    before = _prompt_sources(decode_port)
    remote, expected_external = {}, 0.0
    for chat, stream in KINDS:
        text, extension, usage = _ask(url, chat, stream)
        assert extension["route"] == "remote" and not extension["fallback"], extension
        assert extension["kv_bytes"] > 0, extension
        assert extension["stages"]["decode_ms"] == 0.0, extension  # the first token came before decode's vLLM ran
        assert text, (chat, stream)
        remote[(chat, stream)] = text
        expected_external += usage["prompt_tokens"]  # decode's prompt: the prompt and prefill's first token
    after = _prompt_sources(decode_port)
    assert after["external_kv_transfer"] - before.get("external_kv_transfer", 0.0) == expected_external, after
    assert after["local_compute"] - before.get("local_compute", 0.0) == len(KINDS), after  # the first tokens only
    one, extension, _ = _ask(url, False, False, max_tokens=1)
    assert extension["route"] == "remote" and remote[(False, False)].startswith(one) and one, (one, extension)
    assert _prompt_sources(decode_port) == after  # answered without decode's vLLM
    _assert_no_blob_left(url, proc)
    _assert_tcp_figures(url)

    _drain_prefill(url, proc)
    for chat, stream in KINDS:
        text, extension, _ = _ask(url, chat, stream)
        assert extension["route"] == "local", extension
        assert extension["stages"]["decode_ms"] > 0.0, extension
        assert text == remote[(chat, stream)], (chat, stream)
    assert _prompt_sources(decode_port)["external_kv_transfer"] == after["external_kv_transfer"]


def _assert_tcp_figures(url: str) -> None:
    """The connectors' ``TCP_INFO`` (in the vLLM processes) reach the router through the instances' heartbeats:
    decode's pulls per store (prefill's in direct mode, the relay's in relay mode), prefill's pushes to the relay,
    and the WAN hop's RTT on ``dc-a:dc-b`` (decode's pull from prefill, or prefill's push to the relay)."""
    deadline, instances, link = time.monotonic() + 30, [], {}
    while time.monotonic() < deadline:
        instances = httpx.get(f"{url}/admin/instances", timeout=30).json()
        links = httpx.get(f"{url}/admin/links", timeout=30).json()["links"]
        link = next((x for x in links if x["link"] == "dc-a:dc-b"), {})
        if link.get("rtt_ms", 0) > 0 and all(i["tcp_peers"] for i in instances if i["role"] == "decode"):
            break
        time.sleep(0.5)
    assert link.get("rtt_ms", 0) > 0, link
    address = {i["role"]: i["kv_address"] for i in instances}
    store = address.get("relay") or address["prefill"]
    for info in instances:
        if info["role"] == "decode" or (info["role"] == "prefill" and "relay" in address):
            assert store in {peer["peer"] for peer in info["tcp_peers"]}, info


def _assert_no_blob_left(url: str, proc: Any) -> None:
    """No blob in the relay's store (relay mode) nor in the producer's (direct mode); releases are asynchronous."""
    deadline = time.monotonic() + 30
    while (left := _blobs(url)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"blobs left: {left}"


def _blobs(url: str) -> int:
    reports = httpx.get(f"{url}/admin/kv", timeout=30).json()
    relay = sum(int((report.get("store") or {}).get("blobs", 0)) for report in reports.values())
    prefills = [i for i in httpx.get(f"{url}/admin/instances", timeout=30).json() if i["role"] == "prefill"]
    return relay + sum(int(asyncio.run(client.stat(i["kv_address"], timeout_s=10))["blobs"]) for i in prefills)


def test_a_dead_vllm_server_stops_its_instance(up: tuple[str, Any]) -> None:
    _, proc = up
    instance, server = _instance(proc, "decode"), _vllm_server(proc, "kv_consumer")
    assert instance is not None and server is not None
    engine = descendants(instance)
    os.kill(server[0], signal.SIGKILL)
    line = line_saying(proc, "decode decode-0 exited with code 1", DRAIN_S)
    assert "restarting" in line, line
    deadline = time.monotonic() + 15
    while left := [p for p in engine if alive(p)]:
        assert time.monotonic() < deadline, f"the dead vLLM server left processes behind: {left}"
        time.sleep(0.2)
