"""What ``--dtype auto`` decides from: a square matmul's rate in float32 and in bfloat16 on this CPU, one run.

    .venv/bin/python benchmarks/matmul_dtype.py [--n 512] [--seconds 3] [--threads 2]
        [--out benchmarks/results/matmul_dtype.json]

Where the CPU has no native bfloat16 (no AVX-512 BF16, AMX or Arm BF16) oneDNN emulates it and bfloat16 runs many
times slower than float32; ``prfaas.engine.loader.native_dtype`` then picks float32.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from prfaas.bench.provenance import provenance
from prfaas.engine.loader import native_dtype

HERE = Path(__file__).resolve().parent


def gflops(n: int, dtype: torch.dtype, seconds: float) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    started, runs = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        a @ b
        runs += 1
    return 2 * n**3 * runs / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results" / "matmul_dtype.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rates = {name: round(gflops(args.n, getattr(torch, name), args.seconds), 2) for name in ("float32", "bfloat16")}
    result = {"provenance": provenance(), "n": args.n, "threads": args.threads, "gflops": rates, "auto": native_dtype()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title=f"{args.n}×{args.n} matmul, {args.threads} threads; --dtype auto picks {result['auto']}")
    table.add_column("dtype")
    table.add_column("GFLOP/s", justify="right")
    for name, rate in rates.items():
        table.add_row(name, f"{rate:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
