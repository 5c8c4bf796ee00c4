"""Where a continuous-batching decode step spends its time: torch operator profile of SmolLM2 at batch 32.

    .venv/bin/python benchmarks/engine_profile.py [--batch 32] [--prompt 256] [--steps 10] [--dtype bfloat16]

Prints the top operators by self CPU time and the shares of matmuls, attention, KV copies (``aten::cat``, which
the transformers cache uses to grow K/V every step; the batch's in-place buffers avoid it) and the rest, with the
1-minute load average before and after (others may share the cores).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.engine import load_engine
from prfaas.engine.batch import DecodeBatch, Row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    engine = load_engine(args.model, dtype=args.dtype)
    rng = random.Random(0)
    batch = DecodeBatch(engine, args.batch)
    for i in range(args.batch):
        ids = [rng.randrange(1000, 40000) for _ in range(args.prompt)]
        cache, token, _ = engine.prefill_cache(ids)
        batch.add(Row(str(i), len(ids), token, None, 1), cache)
    batch.step()
    load = os.getloadavg()[0]
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            batch.step()
    step_ms = (time.perf_counter() - started) / args.steps * 1e3
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    groups = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm"), "attention": ("flash_attention", "_efficient"),
              "KV copies (aten::cat)": ("aten::cat",)}
    shares = {name: sum(e.self_cpu_time_total for e in events if any(k in e.key for k in keys)) / total
              for name, keys in groups.items()}
    shares["other"] = 1 - sum(shares.values())
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    print(f"batch {args.batch}, {args.prompt}-token prompts, {args.dtype}: {step_ms:.0f} ms per step "
          f"(profiled), {args.batch / step_ms * 1e3:.1f} tokens/s; torch threads {torch.get_num_threads()}; "
          f"load average {load:.1f} → {os.getloadavg()[0]:.1f}")
    print("; ".join(f"{name} {share:.0%}" for name, share in shares.items()))


if __name__ == "__main__":
    main()
