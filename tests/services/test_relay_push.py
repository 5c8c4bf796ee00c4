"""Relay mode under a burst of remote requests, with real processes: the prefill says ``accepted`` only once the
relay has created the blob, so decode's first read always finds it — no ``KV_NOT_FOUND`` counted as a transfer
failure, no link marked degraded, every request served remotely, nothing left in any store.

The topology of CONTRACTS: the prefill → relay hop is the WAN, decode → relay is inside datacenter B. A proxy in
front of the relay's KV port adds the WAN's one-way delay to pushes (connections that open with a Put) and none to
reads, so a blob announced before the relay holds it is read too early, every time. ``degrade_p99_ms`` is raised:
on a shared test machine a burst's exposed transfer time is CPU queueing, not what this test is about; the success
rate still counts at its default threshold."""

from __future__ import annotations

import asyncio
import re
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from prfaas.audit import verify
from tests.conftest import random_prompt
from tests.services.deploy import free_port, role_processes

MODEL = "tiny-llama"
BURST = 16
WAN_DELAY_S = 0.05


class WanProxy:
    """TCP proxy on its own event loop; a connection whose first control message is a Put waits ``WAN_DELAY_S``."""

    def __init__(self, upstream: int) -> None:
        self.upstream, self.pushes, self.reads = upstream, 0, 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, "127.0.0.1", 0),
                                                       self.loop).result(10)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            head = await creader.readexactly(9)  # "M" u32 length u32 checksum, then the message
            first = head + await creader.readexactly(int.from_bytes(head[1:5], "big"))
            if b"\xa3put" in first:
                self.pushes += 1
                await asyncio.sleep(WAN_DELAY_S)
            else:
                self.reads += 1
            ureader, uwriter = await asyncio.open_connection("127.0.0.1", self.upstream)
            uwriter.write(first)
            await asyncio.gather(_pump(creader, uwriter), _pump(ureader, cwriter))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            cwriter.close()

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            await self.server.wait_closed()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


@contextmanager
def relay_deployment(tmp_path: Path) -> Iterator[tuple[str, WanProxy]]:
    config = tmp_path / "prfaas.yaml"
    config.write_text(yaml.safe_dump({"offload_threshold_tokens": 0, "degrade_p99_ms": 5000,
                                      "audit_log": str(tmp_path / "audit-{instance}.jsonl")}))
    router_port, kv_port = free_port(), free_port()
    proxy = WanProxy(kv_port)
    url = f"http://127.0.0.1:{router_port}"
    serve, common = [sys.executable, "-m", "prfaas", "serve"], ["--config", str(config)]
    roles = [["router", "--port", str(router_port), "--mode", "relay"],
             ["relay", "--router", url, "--instance-id", "relay-0", "--kv-port", str(kv_port),
              "--advertise-kv", f"127.0.0.1:{proxy.port}"],
             ["prefill", "--router", url, "--model", MODEL, "--instance-id", "prefill-0"],
             ["decode", "--router", url, "--model", MODEL, "--instance-id", "decode-0"]]
    try:
        with role_processes([[*serve, *role, *common] for role in roles], url):
            yield url, proxy
    finally:
        proxy.close()



def complete(url: str, i: int) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": random_prompt(40 + (i * 37) % 300, seed=i), "max_tokens": 2, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["prfaas"])


def metric_lines(url: str, name: str) -> list[str]:
    return [line for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines() if line.startswith(name)]


def test_a_burst_of_remote_requests_never_reads_a_blob_before_the_relay_holds_it(tmp_path: Path) -> None:
    with relay_deployment(tmp_path) as (url, proxy):
        with ThreadPoolExecutor(max_workers=8) as pool:
            extensions = list(pool.map(lambda i: complete(url, i), range(BURST)))
        assert proxy.pushes >= BURST and proxy.reads >= BURST, "the KV did not go through the proxy"
        routes = [e["route"] for e in extensions]
        assert routes == ["remote"] * BURST, [e.get("reason") for e in extensions if e["route"] != "remote"]
        assert not any(e.get("fallback") for e in extensions)
        for info in httpx.get(f"{url}/admin/instances").json():
            failures = [line for line in metric_lines(info["url"], "prfaas_transfer_failures_total{")
                        if not re.search(r" 0(\.0)?$", line)]
            assert not failures, f"{info['instance_id']}: {failures}"
        assert metric_lines(url, "prfaas_router_link_degraded ") == ["prfaas_router_link_degraded 0.0"]
        assert sum(r["store"]["blobs"] for r in httpx.get(f"{url}/admin/kv", timeout=10).json().values()) == 0
    verdicts = {chain.name: verify(chain) for chain in tmp_path.glob("audit-*.jsonl")}  # complete after shutdown
    assert all(v.ok for v in verdicts.values()), {name: v.error for name, v in verdicts.items()}
    relay = verdicts["audit-relay-0.jsonl"]  # the store's log: every blob created, and every one ended released
    assert relay.created >= BURST and dict(relay.ended) == {"released": relay.created}, relay
