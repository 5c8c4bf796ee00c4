"""What the engine's prefix cache saves on a multi-turn chat, in process (no serving path, no WAN).

    .venv/bin/python benchmarks/prefix_cache.py [--out benchmarks/results/prefix_cache.json]
        [--models tiny-qwen3-next,smollm2-135m] [--conversations 2] [--turns 6] [--threads 1]

Each conversation starts with one shared system prompt (``--system`` random token ids), then every turn adds a
user message (``--user`` ids) and the previous turn's answer (``--answer`` greedy tokens). Every turn's prompt
is prefilled twice, without the cache (``Engine.prefill_chunks``) and through a ``PrefixPrefill`` of
``--budget-mb``, and its answer generated from each; per turn: prompt tokens, tokens computed, prefill seconds
(median over the conversations) and whether the answers were equal. The JSON is rewritten after each model, so a
run cut short keeps what it measured. The machine is shared: the JSON records the load average before and after;
compare within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from prfaas.bench.provenance import provenance
from prfaas.engine import load_engine
from prfaas.engine.prefix_prefill import PrefixPrefill

CHUNK = 512


def ids(n: int, seed: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def timed(work: Any) -> tuple[Any, int, float]:
    started = time.perf_counter()
    *_, (cache, first, _) = work
    return cache, first, time.perf_counter() - started


def answer(engine: Any, cache: Any, first: int, length: int, tokens: int) -> list[int]:
    return [first, *engine.stream(cache, first, length, tokens - 1)]


def conversation(engine: Any, prefix: PrefixPrefill, system: list[int], seed: int,
                 args: argparse.Namespace) -> list[dict[str, Any]]:
    prompt, rows = list(system), []
    for turn in range(1, args.turns + 1):
        prompt += ids(args.user, seed * 1000 + turn, engine.vocab_size)
        cache, first, plain_s = timed(engine.prefill_chunks(prompt, CHUNK))
        plain = answer(engine, cache, first, len(prompt), args.answer)
        saved_before = prefix.cache.stats.saved_tokens
        cache, first, cached_s = timed(prefix.chunks(prompt, "bench", CHUNK))
        saved = prefix.cache.stats.saved_tokens - saved_before
        cached = answer(engine, cache, first, len(prompt), args.answer)
        rows.append({"turn": turn, "prompt_tokens": len(prompt), "computed_tokens": len(prompt) - saved,
                     "plain_s": plain_s, "cached_s": cached_s, "equal": cached == plain})
        prompt += plain[:-1] if plain[-1] in engine.eos_token_ids else plain
    return rows


def bench(model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    engine = load_engine(model, threads=args.threads)
    prefix = PrefixPrefill(engine, args.budget_mb << 20, "bench")
    system = ids(args.system, 7, engine.vocab_size)
    timed(engine.prefill_chunks(ids(args.system, 8, engine.vocab_size), CHUNK))  # warm-up: first passes are slower
    runs = [conversation(engine, prefix, system, c, args) for c in range(args.conversations)]
    out = []
    for turn in range(args.turns):
        cells = [run[turn] for run in runs]
        plain, cached = (statistics.median(c[k] for c in cells) for k in ("plain_s", "cached_s"))
        out.append({"model": model, "turn": turn + 1, "prompt_tokens": cells[0]["prompt_tokens"],
                    "computed_tokens": statistics.median(c["computed_tokens"] for c in cells),
                    "plain_ms": round(plain * 1e3, 1), "cached_ms": round(cached * 1e3, 1),
                    "speedup": round(plain / cached, 2), "answers_equal": all(c["equal"] for c in cells)})
    out[-1]["cache_mib"] = round(prefix.cache.nbytes / (1 << 20), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    parser.add_argument("--models", default="tiny-qwen3-next,smollm2-135m")
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=128)
    parser.add_argument("--user", type=int, default=32)
    parser.add_argument("--answer", type=int, default=8)
    parser.add_argument("--budget-mb", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    before, rows = os.getloadavg(), []
    print(f"{'model':<16} {'turn':>4} {'prompt':>6} {'computed':>8} {'plain ms':>9} {'cached ms':>9} "
          f"{'speedup':>7} equal", flush=True)
    for model in args.models.split(","):
        for r in bench(model, args):
            rows.append(r)
            print(f"{r['model']:<16} {r['turn']:>4} {r['prompt_tokens']:>6} {r['computed_tokens']:>8} "
                  f"{r['plain_ms']:>9} {r['cached_ms']:>9} {r['speedup']:>7} {r['answers_equal']}", flush=True)
        result = {"provenance": provenance(), "loadavg_before": before, "loadavg_after": os.getloadavg(),
                  "settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
