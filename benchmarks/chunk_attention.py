"""What chunking a prefill costs in attention alone: one causal pass against chunks with the mask a cache implies.

    .venv/bin/python benchmarks/chunk_attention.py [--lengths 4096,8000] [--chunk 512] [--dtype auto] [--repeats 3]
        [--out benchmarks/results/chunk_attention.json]

SmolLM2-135M's attention shape (9 query heads over 3 KV heads, head dim 64), one layer,
``scaled_dot_product_attention(..., enable_gqa=True)`` on the CPU:
- ``whole``: the prompt in one pass, ``is_causal=True`` (what a single forward pass runs);
- ``chunked, masked``: ``--chunk`` queries at a time against every key so far, with the boolean lower-right causal
  mask that transformers builds when a cache already holds earlier tokens (what each chunk after the first runs);
- ``chunked, unmasked``: the same calls without the mask (wrong results, the same arithmetic): what the chunks
  would cost if the mask did not move SDPA off its fast kernel;
- ``prfaas whole`` and ``prfaas chunked, masked``: the same two passes on prfaas's prefill attention kernel
  (``torch.ops.prfaas.prefill_attention``, what the engine runs on the CPU where its kernels build), which takes
  the mask at the causal pass's speed.
Medians of ``--repeats`` with min and max, the three taking turns.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.bench.fair import spread
from prfaas.bench.provenance import provenance

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def cases(n: int, chunk: int, dtype: Any) -> dict[str, Callable[[], None]]:
    import torch
    import torch.nn.functional as F

    q = torch.randn(1, HEADS, n, HEAD_DIM, dtype=dtype)
    k, v = (torch.randn(1, KV_HEADS, n, HEAD_DIM, dtype=dtype) for _ in range(2))

    def whole() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def chunked(masked: bool) -> Callable[[], None]:
        def run() -> None:
            for begin in range(0, n, chunk):
                end = min(n, begin + chunk)
                mask = torch.ones(end - begin, end, dtype=torch.bool).tril(begin) if masked else None
                F.scaled_dot_product_attention(q[:, :, begin:end], k[:, :, :end], v[:, :, :end], attn_mask=mask,
                                               enable_gqa=True)
        return run

    runs = {"whole": whole, "chunked, masked": chunked(True), "chunked, unmasked": chunked(False)}
    from prfaas.engine import native

    kernel = native.prefill_attention()
    if kernel is None:
        return runs
    scale = HEAD_DIM ** -0.5

    def kernel_whole() -> None:
        kernel(q, k, v, None, True, scale)

    def kernel_chunked() -> None:
        for begin in range(0, n, chunk):
            end = min(n, begin + chunk)
            mask = torch.ones(1, end - begin, end, dtype=torch.bool).tril(begin)
            kernel(q[:, :, begin:end], k[:, :, :end], v[:, :, :end], mask, False, scale)

    return {**runs, "prfaas whole": kernel_whole, "prfaas chunked, masked": kernel_chunked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8000")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/chunk_attention.json")
    args = parser.parse_args()
    import torch

    from prfaas.engine.loader import native_dtype

    dtype = native_dtype() if args.dtype == "auto" else args.dtype
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        runs = cases(n, args.chunk, getattr(torch, dtype))
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():
            run()  # warm-up
        for _ in range(args.repeats):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - started) * 1e3)
        floor = spread(times["whole"])["median"] or 1.0
        for name, got in times.items():
            s = spread(got)
            rows.append({"prompt_tokens": n, "case": name, "ms": s["median"], "ms_min": s["min"],
                         "ms_max": s["max"], "vs_whole": (s["median"] or 0.0) / floor})
            print(f"{n} {name}: {s['median']:.0f} ms ({s['min']:.0f}–{s['max']:.0f}), "
                  f"{rows[-1]['vs_whole']:.2f}× whole", flush=True)
    Path(args.out).write_text(json.dumps({"provenance": provenance(), "dtype": dtype, "chunk": args.chunk,
                                          "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                          "repeats": args.repeats, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
