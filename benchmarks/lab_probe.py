"""What the lab delivers versus what was asked: ``prfaas probe`` across the lab's WAN under several settings.
Needs root. Writes ``benchmarks/results/lab_probe.json`` and prints a table.

    .venv/bin/python benchmarks/lab_probe.py

Expected from the settings (see prfaas/lab/spec.py): RTT ≈ 2 × delay; probe jitter (mean |ΔRTT|) ≈ 0.92 × jitter
(four uniform ±J terms per pair of round trips); UDP echo loss ≈ 1 − (1 − loss)², since both ways lose.
It uses its own numbered namespaces, so a lab that is up is not touched.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from prfaas.bench.provenance import provenance
from prfaas.lab import Lab, LinkSettings, Topology

CASES = [
    ("1gbit", LinkSettings(rate="1gbit")),
    ("1gbit + 10 ms ± 2 ms", LinkSettings(rate="1gbit", delay_ms=10, jitter_ms=2)),
    ("1gbit + 25 ms", LinkSettings(rate="1gbit", delay_ms=25)),
    ("1gbit + 1 % loss", LinkSettings(rate="1gbit", loss=0.01)),
    ("200mbit, MTU 1400", LinkSettings(rate="200mbit", mtu=1400)),
]
PORT = 5299


def probe(lab: Lab, topo: Topology) -> dict[str, float]:
    prfaas = [sys.executable, "-m", "prfaas", "probe"]
    server = subprocess.Popen(lab.exec_argv(topo.ns_b, [*prfaas, "serve", "--port", str(PORT), "--host", topo.wan_b,
                                                        "--duration", "120s"]), stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        done = subprocess.run(lab.exec_argv(topo.ns_a, [*prfaas, "run", f"{topo.wan_b}:{PORT}", "--streams", "1",
                                                        "--duration", "4s", "--json"]),
                              capture_output=True, text=True, timeout=120, check=True)
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        server.kill()
        server.wait()


def main() -> None:
    topo = Topology.numbered(5)
    rows = []
    with Lab(topo=topo) as lab:
        for name, link in CASES:
            lab.reset(link)
            got = probe(lab, topo)
            rows.append({"case": name, "asked": link.to_json(), "measured": got})
            print(f"{name:24} {got['bandwidth_bps'] / 1e9:6.3f} Gbit/s  RTT p50 {got['rtt_p50_ms']:6.2f} ms  "
                  f"p99 {got['rtt_p99_ms']:6.2f} ms  jitter {got['jitter_ms']:5.2f} ms  loss {100 * got['loss']:5.2f} %"
                  f"  MTU {got['mtu']}", flush=True)
    out = Path(__file__).resolve().parent / "results" / "lab_probe.json"
    out.write_text(json.dumps({"provenance": provenance(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
