"""KV bytes per codec and length, codec speed, and what lossy codecs do to SmolLM2's tokens.

    .venv/bin/python benchmarks/kv_codecs.py [--out benchmarks/results/kv_codecs.json] [--quick]

Writes one JSON file and prints three tables: KV bytes at 512 / 2K / 8K tokens for SmolLM2 and two hybrids,
encode/decode GB/s (raw KV bytes per second) per codec, and for SmolLM2 the greedy token agreement and mean
KL(exact ‖ lossy) of the next-token distribution under teacher forcing over a few real prompts.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from prfaas.bench.provenance import provenance
from prfaas.demo import chat_ids
from prfaas.engine import load_engine
from prfaas.kv import CODECS, KVState, decode_state, encode_state

MODELS = ("smollm2-135m", "tiny-qwen3-next", "tiny-bamba")
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Explain in three sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper who befriends a seagull.",
    "List five tips for writing clear technical documentation, with one sentence each.",
    "A train leaves at 3 pm travelling at 60 km/h. How far has it gone by 5:30 pm? Show your reasoning.",
    "Summarise the plot of Romeo and Juliet for a ten-year-old.",
]


def kv_sizes(lengths: list[int]) -> list[dict]:
    rows = []
    for name in MODELS:
        engine = load_engine(name)
        for n in lengths:
            rng = random.Random(n)
            out = engine.prefill([rng.randrange(3, 49152) for _ in range(n)])
            row = {"model": name, "seq_len": n, "prefill_s": round(out.seconds, 3),
                   "fixed_bytes": out.kv.fixed_bytes}
            for codec in CODECS:
                row[codec] = len(encode_state(out.kv, codec=codec))
            rows.append(row)
            print(f"  sizes {name} {n}: none={row['none']} bytes, prefill {out.seconds:.2f} s", flush=True)
    return rows


def codec_speed(kv: KVState, repeats: int) -> list[dict]:
    rows = []
    for codec in CODECS:
        enc, dec = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            blob = encode_state(kv, codec=codec)
            t1 = time.perf_counter()
            decode_state(blob)
            dec.append(time.perf_counter() - t1)
            enc.append(t1 - t0)
        rows.append({"codec": codec, "raw_bytes": kv.nbytes, "blob_bytes": len(blob),
                     "encode_gbps": kv.nbytes / min(enc) / 1e9, "decode_gbps": kv.nbytes / min(dec) / 1e9})
    return rows


def codec_quality(steps: int) -> list[dict]:
    engine = load_engine("smollm2-135m")
    stats = {c: {"agree": 0, "steps": 0, "kl": 0.0} for c in CODECS if c != "none"}
    for prompt in PROMPTS:
        ids = chat_ids(engine, prompt)
        out = engine.prefill(ids)
        reference = [out.next_token, *engine.decode(out.kv, out.next_token, steps - 1)]
        exact = torch.log_softmax(engine.continuation_logits(out.kv, reference), dim=-1)
        for codec, s in stats.items():
            lossy_kv = decode_state(encode_state(out.kv, codec=codec))
            lossy = torch.log_softmax(engine.continuation_logits(lossy_kv, reference), dim=-1)
            s["agree"] += int((lossy.argmax(-1) == exact.argmax(-1)).sum())
            s["steps"] += len(reference)
            s["kl"] += float((exact.exp() * (exact - lossy)).sum(-1).sum())
    return [{"codec": c, "token_agreement": s["agree"] / s["steps"], "mean_kl": s["kl"] / s["steps"],
             "steps": s["steps"]} for c, s in stats.items()]


def print_tables(result: dict) -> None:
    console = Console()
    sizes = Table(title="KV blob bytes per request (MiB)")
    for col in ("model", "tokens", "fixed state", *CODECS):
        sizes.add_column(col, justify="right")
    for r in result["sizes"]:
        sizes.add_row(r["model"], str(r["seq_len"]), f"{r['fixed_bytes'] / 2**20:.3f}",
                      *(f"{r[c] / 2**20:.3f}" for c in CODECS))
    speed = Table(title=f"codec speed on SmolLM2's {result['speed_seq_len']}-token KV (GB/s of raw KV)")
    for col in ("codec", "ratio vs none", "encode GB/s", "decode GB/s"):
        speed.add_column(col, justify="right")
    for r in result["speed"]:
        speed.add_row(r["codec"], f"{r['raw_bytes'] / r['blob_bytes']:.2f}x", f"{r['encode_gbps']:.2f}",
                      f"{r['decode_gbps']:.2f}")
    quality = Table(title="SmolLM2 greedy quality under lossy KV (teacher-forced)")
    for col in ("codec", "token agreement", "mean KL (nats)", "steps"):
        quality.add_column(col, justify="right")
    for r in result["quality"]:
        quality.add_row(r["codec"], f"{r['token_agreement'] * 100:.1f}%", f"{r['mean_kl']:.5f}", str(r["steps"]))
    for t in (sizes, speed, quality):
        console.print(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/kv_codecs.json")
    parser.add_argument("--quick", action="store_true", help="shorter lengths and fewer steps")
    args = parser.parse_args()
    lengths = [128, 512] if args.quick else [512, 2048, 8192]
    speed_len = 512 if args.quick else 2048
    engine = load_engine("smollm2-135m")
    rng = random.Random(0)
    kv = engine.prefill([rng.randrange(3, 49152) for _ in range(speed_len)]).kv
    result = {
        "host": {"machine": platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__},
        "sizes": kv_sizes(lengths),
        "speed_seq_len": speed_len,
        "speed": codec_speed(kv, repeats=2 if args.quick else 3),
        "quality": codec_quality(steps=8 if args.quick else 32),
    }
    result["provenance"] = provenance()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_tables(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
