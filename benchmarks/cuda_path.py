"""prfaas on a GPU: the embedded engine's CUDA path and the vLLM connector's block copies, where torch sees a GPU.

    python benchmarks/cuda_path.py [--model smollm2-135m] [--random-weights] [--lengths 1024,4096,8000]
        [--rows 1,8,32] [--steps 20] [--out benchmarks/results/cuda_path.json]

Three parts, all bfloat16 on the first GPU (``--device``):

- ``exact``: each tiny model (one per cache layout prfaas carries) prefills a 300-token prompt on the GPU; its KV
  goes through a blob (bytes) and restores on the GPU, and the greedy tokens decoded from it must equal the GPU's
  own ``model.generate``. The same blob also restores on the CPU (same dtype), whose decode says how far a CPU
  decode instance follows a GPU prefill (other kernels: agreement, not bit-equality, is what is recorded).
- ``engine``: ``--model`` (``--random-weights``: a model of its config with random weights, for timings only,
  where the weights are not on the machine) prefills each length; a decode batch of each row count steps, rows
  joined 8 steps apart as served (``engine_profile.batch``); a prompt's KV is snapshot to host numpy (what a
  prefill instance ships) and encoded into a blob.
- ``profile``: one decode step of 8 rows of ``--model`` under torch's profiler (CPU and CUDA activity): the
  operators with the most host time per step, with their GPU time (a GPU step of a small model is bound by the
  host, so this says what to cut).
- ``connector``: vLLM's attention cache as the connector gets it on a GPU (``[blocks, kv_heads, 16, 2 × head]``
  per layer, FlashAttention's, ``--model``'s shape and 4,096 blocks), a request's blocks of each length gathered
  layer by layer as ``save_kv_layer`` does (``prfaas.vllm.layout.gather``: the host only queues the copy into
  pinned memory; the encoder waits for it), then scattered into another cache as the consumer does; bit for bit.

Medians of ``--steps`` timed repeats after warm-up, with ``torch.cuda.synchronize()`` around each; the JSON records
the GPU, torch and the CPU beside the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.engine_profile import batch as staggered  # a decode batch whose rows join 8 steps apart
from prfaas.bench.provenance import provenance
from prfaas.engine import TINY_MODELS, load_engine, models
from prfaas.kv import decode_state, encode_state
from prfaas.vllm import layout

HERE = Path(__file__).resolve().parent
BLOCK = 16  # vLLM's default block size on a GPU
EXACT_PROMPT, EXACT_TOKENS = 300, 24


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(work: Any, n: int, warm: int = 2) -> float:
    for _ in range(warm):
        work()
    synchronize()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        work()
        synchronize()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e3, 3)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed * 7919 + n)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def exact(device: str) -> list[dict[str, Any]]:
    rows = []
    for name in TINY_MODELS:
        gpu = load_engine(name, dtype="bfloat16", device=device)
        cpu = load_engine(name, dtype="bfloat16", device="cpu")
        ids = prompt(EXACT_PROMPT, 1)
        reference = gpu.generate(ids, EXACT_TOKENS)
        out = gpu.prefill(ids)
        blob = encode_state(out.kv)
        tokens = [out.next_token, *gpu.decode(decode_state(blob), out.next_token, EXACT_TOKENS - 1)]
        on_cpu = [out.next_token, *cpu.decode(decode_state(blob), out.next_token, EXACT_TOKENS - 1)]
        agree = next((i for i, (a, b) in enumerate(zip(on_cpu, reference, strict=False)) if a != b),
                     min(len(on_cpu), len(reference)))
        rows.append({"model": name, "kinds": sorted({e["kind"] for e in gpu.layer_table}), "blob_bytes": len(blob),
                     "gpu_equal": tokens == reference[:len(tokens)], "tokens": len(tokens),
                     "cpu_agrees_for": agree, "fingerprint_equal": gpu.fingerprint == cpu.fingerprint})
        del gpu, cpu
    return rows


def random_model(spec: str, directory: Path) -> str:
    """A model of ``spec``'s config with random weights, saved with its tokenizer (timings only)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = models.smollm2_dir() if spec == models.SMOLLM2 else Path(spec)
    config = AutoConfig.from_pretrained(source)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    return str(directory)


def engine_rows(engine: Any, lengths: list[int], levels: list[int], steps: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in lengths:
        ids = prompt(n)
        ms = median_ms(lambda ids=ids: engine.prefill_cache(ids), max(3, steps // 4))
        cache, _, _ = engine.prefill_cache(ids)
        snap = median_ms(lambda cache=cache, n=n: engine.snapshot(cache, n), max(3, steps // 4))
        kv = engine.snapshot(cache, n)
        encode = median_ms(lambda kv=kv: encode_state(kv), 3, warm=1)
        rows.append({"work": "prefill", "tokens": n, "ms": ms, "tokens_per_s": round(n / ms * 1e3),
                     "kv_bytes": kv.nbytes, "snapshot_ms": snap, "snapshot_gbps": round(kv.nbytes * 8 / snap / 1e6, 1),
                     "encode_ms": encode})
    prompts = [prompt(256, seed) for seed in range(max(levels))]
    for rows_n in levels:
        ms = median_ms(staggered(engine, rows_n, prompts).step, steps)
        rows.append({"work": "decode step", "rows": rows_n, "ms": ms, "tokens_per_s": round(rows_n / ms * 1e3)})
    return rows


def profile_rows(engine: Any, rows_n: int = 8, steps: int = 5, top: int = 12) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    batch = staggered(engine, rows_n, [prompt(256, seed) for seed in range(rows_n)])
    for _ in range(3):
        batch.step()
    synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            batch.step()
        synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"operator": e.key, "calls_per_step": round(e.count / steps, 1),
             "host_ms_per_step": round(e.self_cpu_time_total / steps / 1e3, 3),
             "gpu_ms_per_step": round(getattr(e, "self_device_time_total", 0.0) / steps / 1e3, 3)} for e in events]


def connector_rows(config: Any, lengths: list[int], device: str, steps: int) -> list[dict[str, Any]]:
    text = config.get_text_config(decoder=True)
    heads = int(text.num_key_value_heads)
    head = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    layers = int(text.num_hidden_layers)
    blocks = 4096
    generator = torch.Generator(device=device).manual_seed(0)
    source = [torch.randn(blocks, heads, BLOCK, 2 * head, device=device, generator=generator).to(torch.bfloat16)
              for _ in range(layers)]
    target = [torch.zeros_like(t) for t in source]
    rows = []
    for n in lengths:
        count = -(-n // BLOCK)
        ids = random.Random(n).sample(range(1, blocks), count)
        into = random.Random(n + 1).sample(range(1, blocks), count)
        staged: list[Any] = []

        def save(ids: list[int] = ids, staged: list[Any] = staged) -> float:
            """Every layer's gather as save_kv_layer queues it; returns the host's seconds to queue them."""
            staged.clear()
            started = time.perf_counter()
            staged.extend(layout.gather(layer, ids) for layer in source)
            queued = time.perf_counter() - started
            for _, ready in staged:
                if ready is not None:
                    ready()
            return queued

        for _ in range(2):
            save()
        queued, total = [], []
        for _ in range(steps):
            synchronize()
            started = time.perf_counter()
            queued.append(save())
            total.append(time.perf_counter() - started)
        nbytes = sum(a.nbytes for a, _ in staged)
        scatter = median_ms(lambda staged=staged, into=into: [layout.scatter(t, into, a)
                                                              for t, (a, _) in zip(target, staged, strict=True)],
                            steps)
        equal = all(torch.equal(t[into].view(torch.int16), s[ids].view(torch.int16))
                    for t, s in zip(target, source, strict=True))
        gather_ms = statistics.median(total) * 1e3
        rows.append({"tokens": n, "blocks": count, "layers": layers, "bytes": nbytes,
                     "host_queue_ms": round(statistics.median(queued) * 1e3, 3), "gather_ms": round(gather_ms, 3),
                     "gather_gbps": round(nbytes * 8 / gather_ms / 1e6, 1), "scatter_ms": scatter,
                     "scatter_gbps": round(nbytes * 8 / scatter / 1e6, 1), "bit_equal": equal})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=models.SMOLLM2)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default="1024,4096,8000")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--parts", default="exact,engine,profile,connector")
    parser.add_argument("--out", default=str(HERE / "results" / "cuda_path.json"))
    args = parser.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():  # --device cpu: a dry run of the script itself
        sys.exit("cuda_path.py needs a GPU that torch sees; this torch sees none")
    lengths = [int(x) for x in args.lengths.split(",")]
    levels = [int(x) for x in args.rows.split(",")]
    parts = set(args.parts.split(","))
    gpu = torch.cuda.get_device_name(args.device) if args.device != "cpu" else "none (a dry run on the CPU)"
    result: dict[str, Any] = {
        "provenance": provenance(), "gpu": gpu, "torch": torch.__version__,
        "cuda": torch.version.cuda, "dtype": "bfloat16", "model": args.model, "random_weights": args.random_weights}
    console = Console(width=150)
    if "exact" in parts:
        result["exact"] = exact(args.device)
        table = Table(title="GPU prefill → blob → GPU decode, against the GPU's generate (bfloat16)")
        for col in ("model", "layer kinds", "blob bytes", "GPU exact", "CPU decode agrees for"):
            table.add_column(col)
        for r in result["exact"]:
            table.add_row(r["model"], ",".join(r["kinds"]), f"{r['blob_bytes']:,}", str(r["gpu_equal"]),
                          f"{r['cpu_agrees_for']} of {r['tokens']}")
        console.print(table)
    with tempfile.TemporaryDirectory() as tmp:
        spec = random_model(args.model, Path(tmp)) if args.random_weights else args.model
        engine = load_engine(spec, dtype="bfloat16", device=args.device)
        if "engine" in parts:
            result["engine"] = engine_rows(engine, lengths, levels, args.steps)
            table = Table(title=f"{args.model} on {result['gpu']}, bfloat16")
            for col in ("work", "tokens / rows", "ms", "tokens/s", "KV snapshot ms", "snapshot Gbit/s", "encode ms"):
                table.add_column(col)
            for r in result["engine"]:
                table.add_row(r["work"], str(r.get("tokens", r.get("rows"))), f"{r['ms']:.2f}", str(r["tokens_per_s"]),
                              str(r.get("snapshot_ms", "")), str(r.get("snapshot_gbps", "")),
                              str(r.get("encode_ms", "")))
            console.print(table)
        if "profile" in parts:
            result["profile"] = profile_rows(engine)
            table = Table(title="a decode step of 8 rows: the operators with the most host time (ms per step)")
            for col in ("operator", "calls", "host ms", "GPU ms"):
                table.add_column(col)
            for r in result["profile"]:
                table.add_row(r["operator"], str(r["calls_per_step"]), f"{r['host_ms_per_step']:.2f}",
                              f"{r['gpu_ms_per_step']:.2f}")
            console.print(table)
        if "connector" in parts:
            result["connector"] = connector_rows(engine.model.config, lengths, args.device, args.steps)
            table = Table(title="vLLM connector block copies (FlashAttention layout, bfloat16, block 16)")
            for col in ("tokens", "MB", "host queues ms", "gather ms", "Gbit/s", "scatter ms", "Gbit/s", "bit-equal"):
                table.add_column(col)
            for r in result["connector"]:
                table.add_row(str(r["tokens"]), f"{r['bytes'] / 1e6:.1f}", f"{r['host_queue_ms']:.2f}",
                              f"{r['gather_ms']:.2f}", str(r["gather_gbps"]), f"{r['scatter_ms']:.2f}",
                              str(r["scatter_gbps"]), str(r["bit_equal"]))
            console.print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
