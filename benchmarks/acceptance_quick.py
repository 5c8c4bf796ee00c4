"""The quick acceptance matrix against our own deployment: the lab (1 Gbit WAN), ``prfaas up --lab`` with the real
small model, a monolithic baseline deployment (every prompt prefilled locally) on 127.0.0.1, then
``prfaas bench run --quick``. Needs root; writes ``benchmarks/results/acceptance-quick/`` and prints the table.

    .venv/bin/python benchmarks/acceptance_quick.py [--model smollm2-135m] [--out DIR]

Everything it starts (lab, both deployments) is stopped on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from prfaas.lab import Lab, LinkSettings
from prfaas.services.up import Deployment, UpOptions

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", help="bfloat16 where the CPU has it natively, else float32")
    parser.add_argument("--threshold", type=int, default=256)
    parser.add_argument("--out", default=str(HERE / "results" / "acceptance-quick"))
    parser.add_argument("--port", type=int, default=8300, help="the lab deployment's router; the baseline's is +1")
    parser.add_argument("bench_args", nargs="*", help="extra arguments for prfaas bench run")
    args = parser.parse_args()
    config = str(HERE / "acceptance-config.yaml")
    log = str(Path(args.out).with_suffix(".log"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    common = {"model": args.model, "dtype": args.dtype, "config": config, "log_file": log}
    baseline = Deployment(UpOptions(port=args.port + 1, offload_threshold=1_000_000, **common))
    remote = Deployment(UpOptions(port=args.port, offload_threshold=args.threshold, lab=True, **common))
    with Lab(LinkSettings(rate="1gbit")):
        try:
            for deployment in (baseline, remote):
                deployment.start()
            for deployment in (baseline, remote):
                deployment.wait_ready()
            cmd = [sys.executable, "-m", "prfaas", "bench", "run", "--quick", "--target", remote.url,
                   "--baseline", baseline.url, "--out", args.out, *args.bench_args]
            return subprocess.run(cmd, timeout=1800).returncode
        finally:
            remote.stop()
            baseline.stop()


if __name__ == "__main__":
    sys.exit(main())
