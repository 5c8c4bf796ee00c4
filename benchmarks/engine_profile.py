"""Where a decode step's time goes: prfaas's engine in process, linears plain and packed, prfaas's kernels.

    .venv/bin/python benchmarks/engine_profile.py [--model smollm2-135m] [--dtype auto] [--rows 1,8,32]
        [--prompt 256] [--steps 20] [--repeats 3] [--out benchmarks/results/engine_profile.json]

Four engines of the same model and dtype: ``plain`` (``nn.Linear`` as transformers builds it, PyTorch's attention),
``packed`` (linears on prepacked weights, ``prfaas/engine/packed.py``), ``attention`` (packed, and decode attention
on prfaas's own kernel, ``prfaas/engine/native.py``) and ``fused`` (the default: also the layers on merged
projections and prfaas's RMSNorm, SiLU-and-multiply and rotary kernels, ``prfaas/engine/fused.py``). For each batch
size a decode batch of ``rows`` sequences is built as a served one is: each row's ``--prompt``-token prompt (random
ids, the same for all) is prefilled and joins 8 steps after the one before, so rows sit at different lengths behind
left padding. Each repeat times ``--steps`` steps of every variant in turn (after 3 unmeasured ones), so a load
others put on the machine falls on all alike; rows give the median step and its quartiles over every timed step. One
more series of steps per cell runs under torch's profiler, which splits a step into linear layers, attention
kernels, other operators and what is left (Python and the dispatcher: the wall time no operator accounts for). The
prefill of one prompt is timed the same way.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.bench.fair import spread
from prfaas.bench.provenance import provenance
from prfaas.engine import attention, load_engine, native
from prfaas.engine.attention import KERNEL
from prfaas.engine.batch import DecodeBatch, Row
from prfaas.engine.loader import native_dtype

HERE = Path(__file__).resolve().parent
VARIANTS = ("plain", "packed", "attention", "fused")
STAGGER = 8  # steps between two rows' joins
LINEAR = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
             "prfaas::decode_attention", "prfaas::prefill_attention")


def engine(model: str, dtype: str, variant: str) -> Any:
    """``variant``'s engine (``VARIANTS``)."""
    loaded = load_engine(model, dtype=dtype, packed=variant != "plain", kernels=variant == "fused")
    if variant == "attention" and native.library():
        attention.use_kernel(loaded.model, native.decode_attention())
    return loaded


def batch(engine: Any, rows: int, prompts: list[list[int]]) -> DecodeBatch:
    decode = DecodeBatch(engine, max(64, rows))
    for i, prompt in enumerate(prompts[:rows]):
        cache, first, _ = engine.prefill_cache(prompt)
        decode.add(Row(f"r{i}", len(prompt), first, None, 1), cache)
        if i < rows - 1:
            for _ in range(STAGGER):
                decode.step()
    return decode


def timed(work: Any, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return times


def split(work: Any, n: int) -> dict[str, float]:
    """Per call of ``work`` (ms): linear layers, attention kernels, other operators, the rest of the wall time, and
    that wall time (the profiler's own cost lands in the rest: a profiled call takes longer than a timed one)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(n):
            work()
        wall = time.perf_counter() - started
    parts = {"linear_ms": 0.0, "attention_ms": 0.0, "other_ops_ms": 0.0}
    for event in prof.key_averages():
        key = "linear_ms" if event.key in LINEAR else "attention_ms" if event.key in ATTENTION else "other_ops_ms"
        parts[key] += event.self_cpu_time_total / 1e3
    ops = sum(parts.values())
    return {**{k: round(v / n, 2) for k, v in parts.items()}, "outside_ops_ms": round((wall * 1e3 - ops) / n, 2),
            "profiled_ms": round(wall * 1e3 / n, 2)}


def stats(times: list[float], rows: int) -> dict[str, float]:
    s = spread([t * 1e3 for t in times])
    return {"samples": s["n"], **{f"step_ms{'' if k == 'median' else '_' + k}": round(float(s[k] or 0), 2)
                                  for k in ("median", "q1", "q3", "min", "max")},
            "tokens_per_s": round(rows / float(s["median"] or 1) * 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "engine_profile.json"))
    args = parser.parse_args()
    dtype = native_dtype() if args.dtype == "auto" else args.dtype
    levels = [int(x) for x in args.rows.split(",")]
    engines = {v: engine(args.model, dtype, v) for v in VARIANTS}
    if not any(hasattr(m, KERNEL) for m in engines["fused"].model.modules()):
        raise SystemExit("prfaas's CPU kernels did not build here (see the warning above)")
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt)] for _ in range(max(levels))]
    rows: list[dict[str, Any]] = []
    prefill = {v: (lambda e=e: e.prefill_cache(prompts[0])) for v, e in engines.items()}
    cells: list[tuple[str, int, Any]] = [(v, 0, prefill[v]) for v in VARIANTS]
    for n in levels:
        for v in VARIANTS:
            decode = batch(engines[v], n, prompts)
            cells.append((v, n, decode.step))
    for _, _, work in cells:
        timed(work, 3)
    samples: dict[tuple[str, int], list[float]] = {(v, n): [] for v, n, _ in cells}
    for _ in range(args.repeats):
        for v, n, work in cells:
            samples[(v, n)] += timed(work, args.steps if n else max(2, args.steps // 5))
    for v, n, work in cells:
        row = {"variant": v, "work": f"prefill {args.prompt}" if n == 0 else "decode step", "rows": n,
               **stats(samples[(v, n)], max(n, 1)), **split(work, max(2, args.steps // 4))}
        if n == 0:
            row.pop("tokens_per_s")
            row["prefill_tokens_per_s"] = round(args.prompt / row["step_ms"] * 1e3, 1)
        rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["variant"] == "plain" and r["rows"] == row["rows"])
        row["vs_plain"] = round(base["step_ms"] / row["step_ms"], 3)
    result = {"provenance": provenance(), "model": args.model, "dtype": dtype, "threads": torch.get_num_threads(),
              "prompt": args.prompt, "stagger_steps": STAGGER, "repeats": args.repeats, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title=f"{args.model} {dtype}, {result['threads']} threads: a step's time (ms, medians)")
    for col in ("variant", "work", "rows", "step ms", "q1–q3", "vs plain", "linear", "attention", "other ops",
                "outside ops", "profiled"):
        table.add_column(col, justify="left" if col in ("variant", "work") else "right")
    for r in rows:
        table.add_row(r["variant"], r["work"], str(r["rows"]), f"{r['step_ms']:.1f}",
                      f"{r['step_ms_q1']:.1f}–{r['step_ms_q3']:.1f}", f"{r['vs_plain']:.2f}×", f"{r['linear_ms']:.1f}",
                      f"{r['attention_ms']:.1f}", f"{r['other_ops_ms']:.1f}", f"{r['outside_ops_ms']:.1f}",
                      f"{r['profiled_ms']:.1f}")
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
