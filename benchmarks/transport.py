"""KV transport goodput, one run, same path: prfaas vs iperf3 vs a plain single-socket Python copy vs Mooncake.

    .venv/bin/python benchmarks/transport.py [--size 1GiB] [--size-1g 256MiB] [--repeat 3] [--paths all]
        [--out benchmarks/results/transport.json]

Paths: ``loopback`` (127.0.0.1), ``veth-10gbit`` and ``veth-1gbit`` (two network namespaces joined by a veth
pair, ``tbf`` on both ends; skipped with the reason when namespaces cannot be made). On each path the receiver
runs on the client side (namespace a) and the sender/server on the other (namespace b):
  iperf3 -P N           the wire's ceiling (Debian's iperf3, from scripts/install-system-deps.sh)
  python copy           ``sendall`` of a memoryview in 4 MiB slices → ``recv_into`` a preallocated bytearray
  python tls copy       the same through TLS 1.3 with Python's ``ssl`` module (``tls_copy.py stdlib``): the most
                        any Python data plane on that ``ssl`` module can move, with no protocol and no checksums
  pyopenssl tls copy    the same with pyOpenSSL on the newer OpenSSL inside ``cryptography``'s wheels, reading
                        with ``SSL_read`` itself (``tls_copy.py pyopenssl``; its own venv, made here)
  prfaas [tls] N        ``prfaas bench transfer --target``: push once, pull ``PULLS`` + 1 times into a fresh
                        BlobReader (every chunk verified, layers rebuilt), N striped connections; plaintext and
                        TLS 1.3
  mooncake              Mooncake Transfer Engine's TCP transport (loopback; its own venv, made here)
The machine is shared and noisy, so the tools run side by side: ``--repeat`` rounds, each running every tool in
turn. A sample is one transfer of ``--size`` bytes, and iperf3, the python copy, prfaas and mooncake take the same
number of samples, ``PULLS`` per round (iperf3 and the copy run ``PULLS`` times; each prfaas process pulls ``PULLS``
times after a cold pull). The copy's buffer is a ``bytearray``, zero-filled (its pages touched) before its timer
starts, and a decode instance pulls into arenas it reuses; a process's first pull instead pays for first-touching
its receive arena, so it is not among the samples but reported beside them (``cold_gbps``: their median; every cold
sample in the JSON). The bare TLS copies take one per round. Every figure is the median of a tool's samples, with
quartiles, min and max beside it and every sample in the JSON; never one tool's best. "vs iperf3" divides medians by
iperf3's with the same number of streams (the copies and mooncake by iperf3 -P 1); "vs ceiling" by the highest
iperf3 median of any stream count on that path. ``--size`` defaults to 1 GiB so that a loopback iperf3 sample lasts
a quarter of a second or more (256 MiB took about 65 ms, where start-up noise dominates). Targets: plaintext ≥ 90 %,
TLS ≥ 60 %.

TLS cost (second table): per path and stream count, TLS goodput / plaintext goodput, prfaas TLS goodput / the bare
TLS copy's (same ``ssl`` module, one stream), and the receiving process's CPU seconds per GB pulled (all its
threads: receive, decrypt, verify, rebuild; the median over its pulls, quartiles in the goodput rows) with and
without TLS, beside the bare copy's receiver.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import netns

from prfaas.bench.fair import spread

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python")
MOONCAKE_VENV = ROOT / "benchmarks" / ".venv-mooncake"
PYOPENSSL_VENV = ROOT / "benchmarks" / ".venv-pyopenssl"
STREAMS = (1, 2, 4)
PULLS = 3  # samples per tool and round (a prfaas process pulls once more first, cold)
Wrap = Callable[[str, list[str]], list[str]]


def parse_size(text: str) -> int:
    sys.path.insert(0, str(ROOT))
    from prfaas.units import parse_size as parse

    return parse(text)


@contextlib.contextmanager
def background(argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(Exception):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def iperf3(wrap: Wrap, host: str, size: int, streams: int, repeat: int) -> list[float]:
    samples = []
    for i in range(repeat):
        port = 15201 + i
        with background(wrap("b", ["iperf3", "-s", "-1", "-p", str(port)])):
            time.sleep(0.3)
            out = subprocess.run(wrap("a", ["iperf3", "-c", host, "-p", str(port), "-n", str(size), "-P",
                                            str(streams), "-J"]), capture_output=True, text=True, timeout=300)
        samples.append(json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 1e9)
    return samples


def python_copy(wrap: Wrap, host: str, size: int, repeat: int) -> list[float]:
    samples = []
    for i in range(repeat):
        port = 15301 + i
        with background(wrap("b", [PY, __file__, "plain-send", "0.0.0.0", str(port), str(size)])) as sender:
            assert sender.stdout is not None
            sender.stdout.readline()  # listening
            out = subprocess.run(wrap("a", [PY, __file__, "plain-recv", host, str(port), str(size)]),
                                 capture_output=True, text=True, timeout=300, check=True)
        samples.append(size * 8 / float(out.stdout.strip().splitlines()[-1]) / 1e9)
    return samples


def prfaas(wrap: Wrap, host: str, size: int, streams: int, repeat: int,
           tls: tuple[Path, Path] | None) -> dict[str, Any]:
    argv = [PY, __file__, "relay", "0.0.0.0", "15401"] + ([str(tls[0]), str(tls[1])] if tls else [])
    with background(wrap("b", argv)) as relay:
        assert relay.stdout is not None
        relay.stdout.readline()  # listening
        cmd = [PY, "-m", "prfaas", "bench", "transfer", "--target", f"{host}:15401", "--size", str(size),
               "--streams", str(streams), "--repeat", str(repeat), "--json"] + (["--tls", "--ca", str(tls[0])]
                                                                                if tls else [])
        out = subprocess.run(wrap("a", cmd), capture_output=True, text=True, timeout=600, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"prfaas bench transfer failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def side_venv(venv: Path, package: str) -> Path | str:
    """The interpreter of a benchmark's own virtualenv with ``package`` installed (made on first use), or why not."""
    py = venv / "bin" / "python"
    if not py.exists():
        made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True)
        got = subprocess.run([str(py), "-m", "pip", "install", "-q", package],
                             capture_output=True, text=True) if made.returncode == 0 else made
        if got.returncode != 0:
            return f"{package} did not install: {str(got.stderr)[-300:]}"
    return py


def tls_copy(wrap: Wrap, host: str, size: int, py: str, lib: str, certs: tuple[Path, Path]) -> dict[str, Any]:
    peer, port = str(ROOT / "benchmarks" / "tls_copy.py"), "15351"
    with background(wrap("b", [py, peer, "send", lib, "0.0.0.0", port, str(size), *map(str, certs)])) as sender:
        assert sender.stdout is not None
        sender.stdout.readline()  # listening
        out = subprocess.run(wrap("a", [py, peer, "recv", lib, host, port, str(size), str(certs[0])]),
                             capture_output=True, text=True, timeout=300, check=True)
        sent_cpu = float(sender.stdout.readline())
    seconds, cpu = map(float, out.stdout.split())
    return {"gbps": size * 8 / seconds / 1e9, "cpu_s_per_gb": cpu / (size / 1e9),
            "sender_cpu_s_per_gb": sent_cpu / (size / 1e9)}


def mooncake(size: int, repeat: int) -> list[float] | str:
    py = side_venv(MOONCAKE_VENV, "mooncake-transfer-engine-non-cuda")
    if isinstance(py, str):
        return py
    peer = str(ROOT / "benchmarks" / "mooncake_peer.py")
    with background([str(py), peer, "server", "127.0.0.1", str(size)]) as server:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line:
            return f"mooncake server failed: {server.stderr.read()[-300:] if server.stderr else ''}"
        info = json.loads(line)
        out = subprocess.run([str(py), peer, "client", "127.0.0.1", info["segment"], str(info["addr"]), str(size),
                              str(repeat)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return f"mooncake client failed: {out.stderr[-300:]}"
    return [size * 8 / t / 1e9 for t in json.loads(out.stdout.strip().splitlines()[-1])["seconds"]]


def measure_path(name: str, wrap: Wrap, host: str, size: int, repeat: int, certs: tuple[Path, Path]
                 ) -> list[dict[str, Any]]:
    samples: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}  # receiver CPU s/GB per sample, where the tool reports it
    extra: dict[tuple[str, int], list[dict[str, Any]]] = {}  # the rest of what a tool said, per run
    failed: dict[tuple[str, int], list[str]] = {}
    pyopenssl = side_venv(PYOPENSSL_VENV, "pyopenssl")

    cold: dict[tuple[str, int], list[float]] = {}  # a prfaas process's first pull, into a fresh arena

    def keep(tool: str, n: int, gbps: list[float], said: dict[str, Any] | None = None,
             cpu_s_per_gb: list[float] | None = None, first: list[float] | None = None) -> None:
        samples.setdefault((tool, n), []).extend(gbps)
        cold.setdefault((tool, n), []).extend(first or [])
        cpu.setdefault((tool, n), []).extend(cpu_s_per_gb or [])
        extra.setdefault((tool, n), []).append(said or {})
        print(f"  {tool:<18} {n}  {' / '.join(f'{g:.2f}' for g in gbps)} Gbit/s"
              + (f" (cold {first[0]:.2f})" if first else ""), flush=True)

    for r in range(repeat):
        print(f" round {r + 1}/{repeat}", flush=True)
        for n in STREAMS:
            keep("iperf3", n, iperf3(wrap, host, size, n, PULLS))
        keep("python copy", 1, python_copy(wrap, host, size, PULLS))
        for lib, py in (("python", PY), ("pyopenssl", None if isinstance(pyopenssl, str) else str(pyopenssl))):
            if py is not None:
                got = tls_copy(wrap, host, size, py, "stdlib" if lib == "python" else lib, certs)
                keep(f"{lib} tls copy", 1, [got["gbps"]], got, [got["cpu_s_per_gb"]])
        for tls in (None, certs):
            for n in STREAMS:
                tool = "prfaas tls" if tls else "prfaas"
                try:
                    got = prfaas(wrap, host, size, n, PULLS + 1, tls)
                except RuntimeError as exc:  # counted and shown, not hidden: the bench pulls with retries=0
                    failed.setdefault((tool, n), []).append(str(exc)[-300:])
                    print(f"  {tool:<18} {n}  FAILED: {str(exc)[-200:]}", flush=True)
                    continue
                rates = [size * 8 / t / 1e9 for t in got["pull_seconds"]]
                keep(tool, n, rates[1:], got, got["pull_cpu_s_per_gb"][1:], rates[:1])
    if name == "loopback":
        mc = mooncake(size, repeat * PULLS)
        if isinstance(mc, list):
            keep("mooncake tcp", 1, mc)
        else:
            failed[("mooncake tcp", 1)] = [mc]
    rows = [row(name, tool, n, got, cpu[(tool, n)], extra[(tool, n)], failed.get((tool, n), []), cold[(tool, n)])
            for (tool, n), got in samples.items()]
    rows += [{"path": name, "tool": tool, "streams": n, "gbps": None, "failed_runs": errors}
             for (tool, n), errors in failed.items() if (tool, n) not in samples]
    if isinstance(pyopenssl, str):
        rows.append({"path": name, "tool": "pyopenssl tls copy", "streams": 1, "gbps": None, "note": pyopenssl})
    return ratios(rows)


def row(path: str, tool: str, n: int, gbps: list[float], cpu: list[float], said: list[dict[str, Any]],
        failed: list[str], cold: list[float]) -> dict[str, Any]:
    """One tool's samples on one path: median goodput with its spread, receiver CPU s/GB likewise, and the cold
    first pulls' median apart."""
    rate, spent = spread(gbps), spread(cpu)
    out: dict[str, Any] = {"path": path, "tool": tool, "streams": n, "gbps": rate["median"], "gbps_q1": rate["q1"],
                           "gbps_q3": rate["q3"], "gbps_min": rate["min"], "gbps_max": rate["max"],
                           "samples": rate["n"], "samples_gbps": [round(g, 3) for g in gbps]}
    if cpu:
        out |= {"cpu_s_per_gb": spent["median"], "cpu_s_per_gb_q1": spent["q1"], "cpu_s_per_gb_q3": spent["q3"]}
    if tool.startswith("prfaas"):
        out |= {"push_gbps": statistics.median(s["push_gbps"] for s in said), "chunk_kb": said[0]["chunk_kb"],
                "failed_runs": failed}
    if cold:
        out |= {"cold_gbps": statistics.median(cold), "cold_samples_gbps": [round(g, 3) for g in cold]}
    elif said and "sender_cpu_s_per_gb" in said[0]:
        out["sender_cpu_s_per_gb"] = statistics.median(s["sender_cpu_s_per_gb"] for s in said)
    return out


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``vs_iperf3`` (median over iperf3's median with as many streams; one stream for tools without streams) and
    ``vs_ceiling`` (over the highest iperf3 median on the path)."""
    iperf = {r["streams"]: r["gbps"] for r in rows if r["tool"] == "iperf3" and r["gbps"]}
    wire = max(iperf.values(), default=None)
    for r in rows:
        same = iperf.get(r["streams"] if r["tool"].startswith(("prfaas", "iperf3")) else 1)
        r["vs_iperf3"] = r["gbps"] / same if r["gbps"] is not None and same else None
        r["vs_ceiling"] = r["gbps"] / wire if r["gbps"] is not None and wire else None
    return rows


def tls_cost(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per path and stream count: TLS goodput over plaintext goodput and over the bare TLS copy with the same
    ``ssl`` module (one stream), and the receiving process's CPU seconds per GB, plaintext, TLS and the bare copy."""
    by = {(r["path"], r["tool"], r["streams"]): r for r in rows}
    out = []
    for (path, tool, n), plain in by.items():
        tls = by.get((path, "prfaas tls", n))
        if tool != "prfaas" or tls is None or plain["gbps"] is None or tls["gbps"] is None:
            continue
        copy = by.get((path, "python tls copy", 1), {})
        out.append({"path": path, "streams": n, "goodput_ratio": tls["gbps"] / plain["gbps"],
                    "vs_tls_copy": tls["gbps"] / copy["gbps"] if copy.get("gbps") else None,
                    "plain_cpu_s_per_gb": plain.get("cpu_s_per_gb"), "tls_cpu_s_per_gb": tls.get("cpu_s_per_gb"),
                    "tls_copy_cpu_s_per_gb": copy.get("cpu_s_per_gb")})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| path | tool | streams | Gbit/s (median) | IQR | min–max | n | vs iperf3 | vs ceiling | receiver CPU "
             "s/GB | push Gbit/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gbps = "–" if r.get("gbps") is None else f"{r['gbps']:.2f}"
        iqr = f"{r['gbps_q1']:.2f}–{r['gbps_q3']:.2f}" if r.get("gbps_q1") is not None else "–"
        span = f"{r['gbps_min']:.2f}–{r['gbps_max']:.2f}" if r.get("gbps_min") is not None else "–"
        ratio, wire = ("–" if r.get(k) is None else f"{r[k]:.0%}" for k in ("vs_iperf3", "vs_ceiling"))
        n = f"{r.get('samples', 0)}" + (f" (+{len(r['failed_runs'])} failed)" if r.get("failed_runs") else "")
        spent = f"{r['cpu_s_per_gb']:.2f}" if r.get("cpu_s_per_gb") is not None else ""
        push = f"{r['push_gbps']:.2f}" if "push_gbps" in r else ""
        lines.append(f"| {r['path']} | {r['tool']} | {r['streams']} | {gbps} | {iqr} | {span} | {n} | {ratio} "
                     f"| {wire} | {spent} | {push} |")
    return "\n".join(lines)


def cost_table(cost: list[dict[str, Any]]) -> str:
    lines = ["| path | streams | TLS / plaintext goodput | TLS / python tls copy | receiver CPU s/GB plaintext "
             "| receiver CPU s/GB TLS | python tls copy receiver CPU s/GB |", "|---|---|---|---|---|---|---|"]
    for c in cost:
        cpu = [f"{c[k]:.2f}" if c.get(k) is not None else "–"
               for k in ("plain_cpu_s_per_gb", "tls_cpu_s_per_gb", "tls_copy_cpu_s_per_gb")]
        copy = "–" if c.get("vs_tls_copy") is None else f"{c['vs_tls_copy']:.0%}"
        lines.append(f"| {c['path']} | {c['streams']} | {c['goodput_ratio']:.0%} | {copy} | {cpu[0]} | {cpu[1]} "
                     f"| {cpu[2]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--size-1g", default="256MiB", help="size on the 1 Gbit path (it is 10× slower)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--paths", default="loopback,veth-10gbit,veth-1gbit")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "transport.json"))
    ap.add_argument("--table-from", default="", help="only print the tables of an earlier run's JSON")
    args = ap.parse_args()
    if args.table_from:
        old = json.loads(Path(args.table_from).read_text())
        print(f"{table(old['rows'])}\n\n{cost_table(old['tls_cost'])}")
        return
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    load: dict[str, float] = {}  # 1-minute load average as each path started (2 cores)
    reason = netns.available()
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, str(ROOT))
        from prfaas.bench.provenance import provenance
        from prfaas.bench.transfer import self_signed

        certs = self_signed(Path(tmp), ("127.0.0.1", netns.ADDR["b"]))
        for path in args.paths.split(","):
            print(f"{path} …", flush=True)
            load[path] = os.getloadavg()[0]
            if path == "loopback":
                rows += measure_path(path, lambda side, argv: argv, "127.0.0.1", parse_size(args.size),
                                     args.repeat, certs)
                continue
            if reason:
                skipped[path] = reason
                continue
            rate = path.split("-")[1]
            size = parse_size(args.size_1g if rate == "1gbit" else args.size)
            with netns.veth_pair(rate, "256kb" if rate == "1gbit" else "4mb") as pair:
                rows += measure_path(path, pair.cmd, netns.ADDR["b"], size, args.repeat, certs)
    cost = tls_cost(rows)
    out = {"provenance": provenance(), "rows": rows, "tls_cost": cost, "skipped": skipped, "size": args.size,
           "size_1g": args.size_1g, "repeat": args.repeat, "pulls_per_run": PULLS, "loadavg_by_path": load,
           "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
                    "loadavg": os.getloadavg()}, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(table(rows))
    print()
    print(cost_table(cost))
    for path, why in skipped.items():
        print(f"{path}: skipped ({why})")


# -- helper roles, run as separate processes (possibly inside a namespace) ----------------------------------------

def plain_send(host: str, port: int, size: int) -> None:
    import socket

    srv = socket.create_server((host, port))
    print("listening", flush=True)
    conn, _ = srv.accept()
    view = memoryview(bytearray(4 << 20))
    left = size
    while left:
        n = min(left, len(view))
        conn.sendall(view[:n])
        left -= n
    conn.close()


def plain_recv(host: str, port: int, size: int) -> None:
    import socket

    buf = memoryview(bytearray(size))
    sock = socket.create_connection((host, port))
    start, got = time.perf_counter(), 0
    while got < size:
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise SystemExit("sender closed early")
        got += n
    print(time.perf_counter() - start)


def relay(host: str, port: int, cert: str | None, key: str | None) -> None:
    import asyncio
    import threading

    sys.path.insert(0, str(ROOT))
    from prfaas.bench.transfer import server_context
    from prfaas.store import BlobStore
    from prfaas.transfer import TransferServer

    async def serve() -> None:
        server = TransferServer(BlobStore(8 << 30, 300), host=host, port=port,
                                ssl=server_context(Path(cert), Path(key)) if cert and key else None)
        await server.start()
        print("listening", flush=True)
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(done.set)), daemon=True).start()
        await done.wait()
        await server.close()

    asyncio.run(serve())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("plain-send", "plain-recv", "relay"):
        role, rest = sys.argv[1], sys.argv[2:]
        if role == "relay":
            relay(rest[0], int(rest[1]), rest[2] if len(rest) > 2 else None, rest[3] if len(rest) > 3 else None)
        else:
            (plain_send if role == "plain-send" else plain_recv)(rest[0], int(rest[1]), int(rest[2]))
    else:
        main()
