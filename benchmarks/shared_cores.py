"""Two engine processes on the same cores: decode throughput through ``prfaas up`` against libgomp's spin-wait.

    .venv/bin/python benchmarks/shared_cores.py [--spins 300000,10000,3000,100] [--concurrency 8] [--repeats 2]
        [--out benchmarks/results/shared_cores.json]

``prfaas up`` (SmolLM2, ``--dtype auto``, direct mode) serves ``benchmarks/engine.py``'s request mix (256-token
random prompts, 64 output tokens, streaming, ``usage`` counts) with every prompt prefilled on the prefill instance
(``--offload-threshold 0``: both engines busy) and with every prompt prefilled on the decode instance (100000: one
busy), for each ``GOMP_SPINCOUNT`` given to its processes: 300,000 is libgomp's default, 10,000 what ``prfaas up``
sets (``prfaas.services.up.SHARED_SPIN``), 100 what libgomp falls to once a process holds more pool threads than
cores. One deployment per setting, warmed with the measured shape; rows give the median over ``--repeats`` rounds
with min and max, and the CPU seconds the deployment spent per 1,000 output tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from engine import PROMPT_IDS, WARM_IDS, load, prfaas_dtype, prfaas_up, prompts, resolve  # noqa: E402

from prfaas.bench.fair import tree_cpu_s  # noqa: E402
from prfaas.bench.provenance import provenance  # noqa: E402

MODEL = "smollm2-135m"
PLACES = {0: "prefill instance (both busy)", 100000: "decode instance (one busy)"}


def measure(spin: str, threshold: int, dtype: str, c: int, repeats: int) -> dict[str, Any]:
    with prfaas_up(MODEL, dtype, 64, threshold=threshold, env={"GOMP_SPINCOUNT": spin}) as (url, pid):
        asyncio.run(load(url, MODEL, c, prompts(c, WARM_IDS, -c)))
        runs, spent = [], tree_cpu_s(pid)
        for r in range(repeats):
            runs.append(asyncio.run(load(url, MODEL, c, prompts(c, PROMPT_IDS, 1000 * c + r))))
        cpu = tree_cpu_s(pid) - spent
        read_back = prfaas_dtype(url)
    rates = [r["tokens_per_s"] for r in runs]
    tokens = sum(r["output_tokens"] for r in runs)
    return {"spin": int(spin), "prefilled_on": PLACES[threshold], "concurrency": c, "dtype": read_back,
            "rounds": repeats, "tokens_per_s": statistics.median(rates), "tokens_per_s_min": min(rates),
            "tokens_per_s_max": max(rates), "tpot_p50_ms": statistics.median(r["tpot_p50_ms"] for r in runs),
            "cpu_s_per_1k_tokens": cpu / tokens * 1e3, "loadavg": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spins", default="300000,10000,3000,100")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=str(HERE / "results" / "shared_cores.json"))
    args = ap.parse_args()
    dtype = resolve(args.dtype)
    rows = []
    for threshold in PLACES:
        for spin in args.spins.split(","):
            rows.append(measure(spin, threshold, dtype, args.concurrency, args.repeats))
            print(f"  {rows[-1]}", flush=True)
    Path(args.out).write_text(json.dumps({"provenance": provenance(), "model": MODEL, "dtype_asked": args.dtype,
                                          "rows": rows}, indent=1) + "\n")
    table = Table(title=f"decode through prfaas up, {MODEL}, {dtype}, {args.concurrency} clients")
    for name in ("prefilled on", "GOMP_SPINCOUNT", "tok/s", "min–max", "TPOT ms", "CPU s / 1k tok"):
        table.add_column(name)
    for r in rows:
        table.add_row(r["prefilled_on"], str(r["spin"]), f"{r['tokens_per_s']:.1f}",
                      f"{r['tokens_per_s_min']:.1f}–{r['tokens_per_s_max']:.1f}", f"{r['tpot_p50_ms']:.1f}",
                      f"{r['cpu_s_per_1k_tokens']:.1f}")
    Console().print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
