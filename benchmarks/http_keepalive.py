"""A request on a kept-alive connection to a prfaas HTTP server, with and without ``TCP_NODELAY`` on its sockets.

    .venv/bin/python benchmarks/http_keepalive.py [--requests 20] [--out FILE.json]

One FastAPI app served by ``prfaas.services.http.serve`` (uvicorn, as every prfaas role serves), in a process
of its own, on two listening sockets in turn: one made as ``http.bind`` makes it (protocol ``IPPROTO_TCP``:
asyncio sets ``TCP_NODELAY`` on the connections it accepts), one with protocol 0 (asyncio leaves Nagle's
algorithm on). For each, one client (``httpx.Client``, one connection kept alive) times ``--requests`` requests of
each kind: ``GET`` of a small JSON answer (``small``: headers and body are two writes), and ``POST`` of a
460-token-id body answered with a one-line NDJSON stream (``stream``: the shape of a decode instance's
``/generate`` whose first token is already known). Reports the median and min–max per socket and kind; writes
JSON with the machine's provenance and load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.bench.provenance import provenance
from prfaas.services import http

START_S = 10.0


def app() -> FastAPI:
    served = FastAPI()

    @served.get("/small")
    async def small() -> dict[str, bool]:
        return {"ok": True}

    @served.post("/stream")
    async def stream() -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b'{"event": "token", "token": 1}\n'
        return StreamingResponse(body(), media_type="application/x-ndjson")

    return served


def listening(protocol: int) -> socket.socket:
    """A loopback listening socket: ``http.bind``'s, or the same made with protocol 0."""
    if protocol == socket.IPPROTO_TCP:
        return http.bind("127.0.0.1", 0)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def serve(protocol: int) -> None:
    """The server process: say the port on stdout, then serve until killed."""
    sock = listening(protocol)
    print(sock.getsockname()[1], flush=True)
    asyncio.run(http.serve(app(), sock))


def serving(protocol: int) -> tuple[subprocess.Popen[str], str]:
    """This script as a server process of its own (no interpreter lock shared with the client); its URL once it
    answers."""
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(protocol)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/small", timeout=1)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"the server on {url} did not answer within {START_S} s")


def times(client: httpx.Client, url: str, kind: str, requests: int) -> list[float]:
    body = {"token_ids": list(range(1000, 1460))}
    out = []
    for _ in range(requests):
        started = time.perf_counter()
        if kind == "small":
            client.get(f"{url}/small").raise_for_status()
        else:
            with client.stream("POST", f"{url}/stream", json=body) as reply:
                next(reply.iter_lines())
        out.append(round((time.perf_counter() - started) * 1e3, 2))
    return out


def measured(name: str, url: str, requests: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    with httpx.Client(timeout=30) as client:
        times(client, url, "small", 2)  # the connection is made and warm: every timed request reuses it
        for kind in ("small", "stream"):
            values = times(client, url, kind, requests)
            rows.append({"socket_protocol": name, "request": kind, "n": len(values),
                         "median_ms": round(statistics.median(values), 2), "min_ms": min(values),
                         "max_ms": max(values)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "http_keepalive.json")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process's own flag
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    meta, rows = provenance(), []
    for name, protocol in (("IPPROTO_TCP (http.bind)", socket.IPPROTO_TCP), ("0 (Nagle on)", 0)):
        proc, url = serving(protocol)
        try:
            rows += measured(name, url, args.requests)
        finally:
            proc.kill()
            proc.wait()
    result = {"provenance": meta, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for row in rows:
        print(f"{row['socket_protocol']:24} {row['request']:7} median {row['median_ms']:7.2f} ms "
              f"({row['min_ms']}–{row['max_ms']})")


if __name__ == "__main__":
    main()
