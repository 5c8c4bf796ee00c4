"""The planner's predictions against the lab: for each link setting, ``prfaas probe`` measures the link,
``prfaas plan link`` predicts from the probe's JSON, and a fixed prompt mix served remote through ``prfaas up
--lab`` says what happened.

    .venv/bin/python benchmarks/planner_lab.py [--rates 1gbit,10gbit] [--rtts 1,10,50] [--losses 0,1]
                                               [--repeats 3]

The grid is rate × RTT × loss (default: the full 12 settings, 1 and 10 Gbit; RTT 1, 10, 50 ms; 0 and 1 % loss
per direction). The model is ``synthetic-kimi-linear-48b`` (prfaas.engine.synthetic): the true KV
sizes of Kimi-Linear-48B (31.2 / 56.0 / 155.1 MB at 1,024 / 4,096 / 16,384 tokens) and its modelled H200 prefill
times, without compute, so the run measures the transfer and not this host's CPUs. The planner reads the KV sizes
from the published config (``tests/plan/fixtures/kimi-linear-48b-a3b-instruct.json``, bfloat16) and the prefill
times from ``prfaas measure`` of the same engine (``--profile``).

Per setting it compares, predicted against measured: the KV bytes of each length (the plan's tensor bytes against
the blob's tensor bytes from ``prfaas measure``, exact; and the served blobs' bytes against the measured blob,
exact), the ``transfer_ms`` stage P50 / P99 and the exposed transfer (stage − queue − prefill) P50 / P99 over the
mix (within 15 %, or 10 ms where the figure is a few ms), and the verdict: the plan's against the same rules
applied to the measured figures.

Requests go one at a time (the link carries one blob at a time), so the plan runs at a QPS whose load leaves the
link nearly free (``QPS``). The router's link-health fallback is turned off (``degrade_p99_ms`` large) so that every
prompt of the mix goes remote whatever the link does. Writes ``benchmarks/results/planner_lab.json`` and prints a
table. Needs root; builds its own numbered lab (``Topology.numbered(LAB_INDEX)``), so a default lab that is up is
not touched.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from prfaas.bench.background import start_up, stop_up
from prfaas.bench.client import RequestRecord, request_body, send
from prfaas.bench.fair import tree_cpu_s
from prfaas.bench.provenance import provenance
from prfaas.bench.stats import percentile
from prfaas.lab import Lab, LinkSettings, Topology
from prfaas.plan.link import Check, recheck, verdict_json

ROOT = Path(__file__).resolve().parent.parent
MODEL = "synthetic-kimi-linear-48b"
CONFIG = ROOT / "tests" / "plan" / "fixtures" / "kimi-linear-48b-a3b-instruct.json"
LENGTHS = (1024, 4096, 16384)
LAB_INDEX = 10  # clear of the tests' (7, 8, 9), lab_probe's (5) and vllm_pd's (11)
TOPO = Topology.numbered(LAB_INDEX)
PORT, PROBE_PORT, TCP_PORT = 8430, 5297, 5296
QPS = 0.02  # the plan's load: one request at a time leaves the link free (ρ ≈ 1 % at 1 Gbit)
TTFT_BUDGET_MS, E2E_BUDGET_MS = 2000.0, 10000.0  # transfer_p99 limit: 15 % of 10 s = 1.5 s
TOLERANCE = 0.15
TOLERANCE_MS = 10.0  # or this close: an exposure the prefill hides is a few ms, where a relative error means nothing
VOCAB_LOW, VOCAB_SPAN = 1000, 1000  # the synthetic tokenizer's byte tokens: random ids share no prefix


def prfaas(*args: str) -> list[str]:
    return [sys.executable, "-m", "prfaas", *args]


def last_json(argv: list[str], timeout_s: float = 300) -> dict[str, Any]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=True, cwd=ROOT)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def probe(lab: Lab) -> dict[str, Any]:
    """``prfaas probe`` from dc-a (where prefill pushes from) to dc-b (where the relay is), one stream."""
    server = subprocess.Popen(lab.exec_argv(TOPO.ns_b, prfaas("probe", "serve", "--port", str(PROBE_PORT), "--host",
                                                              TOPO.wan_b, "--duration", "120s")),
                              stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        return last_json(lab.exec_argv(TOPO.ns_a, prfaas("probe", "run", f"{TOPO.wan_b}:{PROBE_PORT}", "--streams",
                                                         "1", "--duration", "3s", "--json")), 120)
    finally:
        server.kill()
        server.wait()


def tcp_sink(host: str, port: int) -> None:
    """``--tcp-sink``: per connection read an 8-byte length and that many bytes, then answer with the monotonic
    time the last byte arrived (namespaces share the host's clock, so the sender gets the one-way time)."""
    server = socket.create_server((host, port))
    buf = bytearray(4 << 20)
    while True:
        conn, _ = server.accept()
        with conn:
            need = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "big")
            while need > 0:
                got = conn.recv_into(buf, min(len(buf), need))
                if not got:
                    break
                need -= got
            conn.sendall(struct.pack(">d", time.monotonic()))


def tcp_send(host: str, port: int, sizes: list[int]) -> None:
    """``--tcp-send``: each size over a fresh connection (as a push opens one); prints one JSON line of
    milliseconds from ``connect`` to the last byte's arrival."""
    data = memoryview(bytearray(max(sizes)))
    out = []
    for size in sizes:
        started = time.monotonic()
        with socket.create_connection((host, port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(size.to_bytes(8, "big"))
            conn.sendall(data[:size])
            arrived = struct.unpack(">d", conn.recv(8, socket.MSG_WAITALL))[0]
        out.append({"bytes": size, "wire_ms": (arrived - started) * 1e3})
    print(json.dumps({"rows": out}))


def reference(lab: Lab, sizes: list[int]) -> list[dict[str, Any]]:
    """A plain TCP connection per blob through the same link just before serving: what the link and this host
    deliver now, the reference that separates the model's error from the serving path's."""
    me = [sys.executable, str(Path(__file__).resolve())]
    sink = subprocess.Popen(lab.exec_argv(TOPO.ns_b, [*me, "--tcp-sink", TOPO.wan_b, str(TCP_PORT)]))
    try:
        time.sleep(1.0)
        argv = lab.exec_argv(TOPO.ns_a, [*me, "--tcp-send", TOPO.wan_b, str(TCP_PORT), ",".join(map(str, sizes))])
        return list(last_json(argv, 300)["rows"])
    finally:
        sink.kill()
        sink.wait()


def plan(link_file: Path, profile_file: Path) -> dict[str, Any]:
    mix = "hist:" + ",".join(f"{n}=1" for n in LENGTHS)
    return last_json(prfaas("plan", "link", "--config", str(CONFIG), "--dtype", "bfloat16", "--link", str(link_file),
                            "--profile", str(profile_file), "--mix", mix, "--qps", str(QPS), "--ttft-budget-ms",
                            str(TTFT_BUDGET_MS), "--e2e-budget-ms", str(E2E_BUDGET_MS), "--mode", "relay",
                            "--json"))


async def serve(url: str, lengths: list[int], seed: int) -> list[RequestRecord]:
    rng = random.Random(seed)
    out = []
    async with httpx.AsyncClient() as client:
        for n in lengths:
            body = request_body(MODEL, [VOCAB_LOW + rng.randrange(VOCAB_SPAN) for _ in range(n)], max_tokens=4)
            out.append(await send(client, url, body, epoch=0.0, timeout_s=300))
    return out


def stage(record: RequestRecord, key: str) -> float | None:
    value = (record.prfaas.get("stages") or {}).get(key)
    return None if value is None else float(value)


def measured(records: list[RequestRecord]) -> dict[str, Any]:
    """Transfer stage and exposed transfer (ms) of the remote requests: P50 and P99 over the mix, per length."""
    remote = [r for r in records if r.ok and r.prfaas.get("route") == "remote" and stage(r, "transfer_ms")]
    rows = [(r.input_len, int(r.prfaas.get("kv_bytes") or 0), stage(r, "transfer_ms") or 0.0,
             max(0.0, (stage(r, "transfer_ms") or 0.0) - (stage(r, "queue_ms") or 0.0)
                 - (stage(r, "prefill_ms") or 0.0)))  # clamped, as the router's exposed-transfer metric is
            for r in remote]
    transfer, exposed = [t for _, _, t, _ in rows], [e for _, _, _, e in rows]
    per_length = [{"seq_len": n, "kv_bytes": sorted({b for m, b, _, _ in rows if m == n}),
                   "stage_ms": [round(t, 1) for m, _, t, _ in rows if m == n],
                   "exposed_ms": [round(e, 1) for m, _, _, e in rows if m == n],
                   "stages": [r.prfaas.get("stages") for r in remote if r.input_len == n]} for n in LENGTHS]
    return {"requests": len(records), "remote": len(remote), "failed": sum(not r.ok for r in records),
            "local_reasons": sorted({str(r.prfaas.get("reason")) for r in records if r.ok and r not in remote}),
            "stage_p50_ms": percentile(transfer, 50), "stage_p99_ms": percentile(transfer, 99),
            "exposed_p50_ms": percentile(exposed, 50), "exposed_p99_ms": percentile(exposed, 99),
            "per_length": per_length}


def measured_verdict(predicted: dict[str, Any], probe_json: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """The plan's rules applied to what was measured: the probe's RTT and loss (the same inputs), and for
    ``transfer_p99`` the measured transfer stage P99 (the bandwidth rule's demand is the plan's: same QPS)."""
    checks = [Check(**{**c, "value": c["value"] if c["value"] is not None else float("inf")})
              for c in predicted["checks"]]
    values = {"rtt": float(probe_json["rtt_p99_ms"]), "loss": 100 * float(probe_json["loss"]),
              "transfer_p99": float(got["stage_p99_ms"] or float("inf"))}
    out = verdict_json(recheck(checks, values), 0, {}, [])
    return {"verdict": out["verdict"], "failed": out["failed"], "tight": out["tight"]}


def off(predicted: float | None, got: float | None) -> float | None:
    """(predicted − measured) / measured, or None where either is missing."""
    if predicted is None or not got:
        return None
    return round((predicted - got) / got, 3)


def compare(predicted: dict[str, Any], profile: dict[str, Any], got: dict[str, Any],
            verdict: dict[str, Any]) -> dict[str, Any]:
    t = predicted["transfer"]
    blob = {int(r["seq_len"]): int(r["bytes"]) for r in profile["kv"]}
    tensors = {int(r["seq_len"]): int(r["tensor_bytes"]) for r in profile["kv"]}
    served_exact = all(row["kv_bytes"] == [blob[row["seq_len"]]] for row in got["per_length"])
    plan_exact = all(r["kv_bytes"] == tensors[r["seq_len"]] for r in t["per_length"])
    pairs = {k: (t["over_mix"][f"{k}_ms"], got[f"{k}_ms"])
             for k in ("stage_p50", "stage_p99", "exposed_p50", "exposed_p99")}
    errors = {k: off(p, m) for k, (p, m) in pairs.items()}
    gaps = {k: None if p is None or m is None else round(p - m, 1) for k, (p, m) in pairs.items()}
    close = [g is not None and (abs(g) <= TOLERANCE_MS or (e is not None and abs(e) <= TOLERANCE))
             for g, e in ((gaps[k], errors[k]) for k in pairs)]
    return {"kv_bytes_plan_exact": plan_exact, "kv_bytes_served_exact": served_exact,
            "predicted_ms": {k: None if p is None else round(p, 1) for k, (p, _) in pairs.items()},
            "measured_ms": {k: None if m is None else round(m, 1) for k, (_, m) in pairs.items()},
            "error": errors, "error_ms": gaps, "within": all(close),
            "verdict_predicted": predicted["verdict"], "verdict_measured": verdict["verdict"],
            "verdict_same": predicted["verdict"] == verdict["verdict"]}


def wire_comparison(predicted: dict[str, Any], tcp: list[dict[str, Any]], got: dict[str, Any]) -> list[dict[str, Any]]:
    """Per length: the plan's wire time (fresh connection, ``prfaas.plan.transfer.wire_ms``) against a plain TCP
    connection's through the same link (mean of its samples), the served transfer stage's median against both, and
    the prefill the instance reported (median) against the plan's (forward pass, encoding, a push's back-pressure)."""
    out = []
    for row, served in zip(predicted["transfer"]["per_length"], got["per_length"], strict=True):
        samples = [r["wire_ms"] for r in tcp if r["bytes"] == next(iter(served["kv_bytes"]), None)]
        plain = sum(samples) / len(samples) if samples else None
        stage = percentile(served["stage_ms"], 50)
        prefill = percentile([float(s["prefill_ms"]) for s in served["stages"] if s and "prefill_ms" in s], 50)
        out.append({"seq_len": row["seq_len"], "plan_wire_ms": row["wire_ms"],
                    "tcp_wire_ms": None if plain is None else round(plain, 1),
                    "plan_vs_tcp": off(row["wire_ms"], plain),
                    "stage_p50_ms": stage, "plan_stage_ms": row["stage_ms"], "stage_vs_tcp": off(stage, plain),
                    "instance_prefill_p50_ms": prefill, "plan_instance_prefill_ms": row["instance_prefill_ms"],
                    "plan_vs_instance_prefill": off(row["instance_prefill_ms"], prefill)})
    return out


def grid(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    rates = args.rates.split(",")
    rtts = [float(x) for x in args.rtts.split(",")]
    losses = [float(x) / 100 for x in args.losses.split(",")]
    return list(itertools.product(rates, rtts, losses))


def cpu_use(host_before: Any, deployment_before: float, wall_before: float, up_pid: int,
            kv_bytes: int) -> dict[str, float]:
    """What the requests of a setting cost this host: the share of all its cores busy (every process: the
    deployment, the lab's delay line, this client), and the deployment's processes' CPU seconds per GB of KV."""
    host, wall = psutil.cpu_times(), time.perf_counter() - wall_before
    idle = (host.idle + getattr(host, "iowait", 0.0)) - (host_before.idle + getattr(host_before, "iowait", 0.0))
    total = sum(host) - sum(host_before)
    deployment = tree_cpu_s(up_pid) - deployment_before
    return {"host_busy_share": round(1 - idle / total, 3) if total > 0 else 0.0, "wall_s": round(wall, 2),
            "deployment_cpu_s_per_gb": round(deployment / kv_bytes * 1e9, 3) if kv_bytes else 0.0}


def run_setting(lab: Lab, url: str, rate: str, rtt_ms: float, loss: float, tmp: Path, profile_file: Path,
                profile: dict[str, Any], repeats: int, up_pid: int) -> dict[str, Any]:
    settings = LinkSettings(rate=rate, delay_ms=rtt_ms / 2, loss=loss)
    lab.reset(settings)
    probed = probe(lab)
    link_file = tmp / "link.json"
    link_file.write_text(json.dumps(probed))
    predicted = plan(link_file, profile_file)
    blob = {int(r["seq_len"]): int(r["bytes"]) for r in profile["kv"]}
    tcp = reference(lab, [blob[n] for n in LENGTHS for _ in range(2)])
    load_before = provenance()["machine"]["load_average"]  # type: ignore[index]
    host_before, deployment_before, wall_before = psutil.cpu_times(), tree_cpu_s(up_pid), time.perf_counter()
    records = asyncio.run(serve(url, list(LENGTHS) * repeats, seed=int(rtt_ms * 10 + loss * 1000)))
    got = measured(records)
    got["cpu"] = cpu_use(host_before, deployment_before, wall_before, up_pid,
                         sum(int(r.prfaas.get("kv_bytes") or 0) for r in records if r.ok))
    verdict = measured_verdict(predicted, probed, got)
    row = {"rate": rate, "rtt_ms": rtt_ms, "loss_pct": loss * 100, "asked": settings.to_json(),
           "probe": {k: probed.get(k) for k in ("bandwidth_bps", "rtt_p50_ms", "rtt_p99_ms", "jitter_ms", "loss",
                                                 "mtu")},
           "load_average_before": load_before, "plan": {k: predicted[k] for k in ("verdict", "failed", "tight",
                                                                                    "checks", "transfer")},
           "measured": got, "measured_verdict": verdict, "tcp_reference": tcp}
    row["comparison"] = compare(predicted, profile, got, verdict)
    row["wire"] = wire_comparison(predicted, tcp, got)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="1gbit,10gbit")
    parser.add_argument("--rtts", default="1,10,50", help="round-trip times in ms (the delay is half each way)")
    parser.add_argument("--losses", default="0,1", help="loss per direction in percent")
    parser.add_argument("--repeats", type=int, default=3, help="requests per length per setting")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planner_lab.json"))
    parser.add_argument("--tcp-sink", nargs=2, metavar=("HOST", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--tcp-send", nargs=3, metavar=("HOST", "PORT", "SIZES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tcp_sink:
        return tcp_sink(args.tcp_sink[0], int(args.tcp_sink[1]))
    if args.tcp_send:
        return tcp_send(args.tcp_send[0], int(args.tcp_send[1]), [int(n) for n in args.tcp_send[2].split(",")])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stop still takes the deployment and the lab down
    with tempfile.TemporaryDirectory(prefix="prfaas-planner-lab-") as scratch:
        run_grid(args, Path(scratch))


def run_grid(args: argparse.Namespace, tmp: Path) -> None:
    """The profile, the lab and one deployment for the whole grid; ``tmp`` holds the profile, the link file, the
    config and the deployment's log."""
    profile = last_json(prfaas("measure", "--model", MODEL, "--seq-len", ",".join(map(str, LENGTHS)), "--repeats",
                               "3", "--json"))
    profile_file = tmp / "profile.json"
    profile_file.write_text(json.dumps(profile))
    config = tmp / "config.yaml"
    config.write_text("degrade_p99_ms: 600000\n")  # every prompt remote: the link's health never sends it local
    rows = []
    began = time.perf_counter()
    with Lab(LinkSettings(rate="1gbit"), topo=TOPO) as lab:
        proc = start_up(["--lab", "--lab-index", str(LAB_INDEX), "--model", MODEL, "--port", str(PORT),
                         "--offload-threshold", "64", "--config", str(config)], tmp / "up.log", cwd=ROOT)
        try:
            url = f"http://{TOPO.wires[0].public}:{PORT}"
            # warm-up, every measured length once: connections opened, each size's first request (the frame
            # pools' first fill on every role) paid before any setting is measured
            asyncio.run(serve(url, list(LENGTHS), seed=99))
            for rate, rtt_ms, loss in grid(args):
                row = run_setting(lab, url, rate, rtt_ms, loss, tmp, profile_file, profile, args.repeats, proc.pid)
                rows.append(row)
                write_report(args, profile, rows, began)
                print(line(row), flush=True)
        finally:
            stop_up(proc)


def write_report(args: argparse.Namespace, profile: dict[str, Any], rows: list[dict[str, Any]],
                 began: float) -> None:
    """The JSON of the settings done so far (rewritten after each one: a cut run keeps what it measured)."""
    report = {"provenance": provenance(), "model": MODEL, "plan_config": str(CONFIG.relative_to(ROOT)),
              "lengths": list(LENGTHS), "repeats": args.repeats, "qps": QPS, "ttft_budget_ms": TTFT_BUDGET_MS,
              "e2e_budget_ms": E2E_BUDGET_MS, "tolerance": TOLERANCE, "tolerance_ms": TOLERANCE_MS,
              "wall_s": round(time.perf_counter() - began, 1),
              "profile": profile, "rows": rows,
              "wire_rows": [{"rate": r["rate"], "rtt_ms": r["rtt_ms"], "loss_pct": r["loss_pct"], **w}
                            for r in rows for w in r["wire"]],
              "notes": ["one request at a time; every prompt remote (relay mode, one prefill in dc-a, relay and "
                        "decode in dc-b)",
                        "delay is the lab's user-space delay line (no netem here): the probe's bandwidth is what a "
                        "setting delivered, which on delayed 10 Gbit settings is less than asked",
                        "stage = the transfer_ms stage decode reports (from the request reaching decode to the last "
                        "byte pulled); exposed = max(0, stage - queue - prefill) (the prefill the instance reports: "
                        "forward pass, encoding and a push's back-pressure)"]}
    Path(args.out).write_text(json.dumps(report, indent=1))


def line(row: dict[str, Any]) -> str:
    c, p = row["comparison"], row["probe"]
    err = " ".join(f"{k} {v:+.0%}" if v is not None else f"{k} -" for k, v in c["error"].items())
    return (f"{row['rate']:>6} RTT {row['rtt_ms']:4.0f} ms loss {row['loss_pct']:3.0f} %  probe "
            f"{p['bandwidth_bps'] / 1e9:5.2f} Gbit/s {p['rtt_p50_ms']:6.2f} ms  remote {row['measured']['remote']:2}  "
            f"{err}  verdict {c['verdict_predicted']} / {c['verdict_measured']}  bytes "
            f"{'exact' if c['kv_bytes_plan_exact'] and c['kv_bytes_served_exact'] else 'DIFFER'}  cores busy "
            f"{row['measured']['cpu']['host_busy_share']:.0%}")


if __name__ == "__main__":
    main()
