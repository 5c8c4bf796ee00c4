"""What makes a comparison between prfaas and a peer fair, as small pure functions the benchmarks share.

- Tokens are counted from the server's own ``usage`` (``stream_options.include_usage``), never from stream
  chunks: one server may send a closing chunk with empty text, another may skip a token whose text is empty.
- The dtype each system actually runs is read back from the system itself (vLLM's start-up log, prfaas's
  fingerprint on ``/admin/pools``), so a peer that quietly casts a checkpoint shows up in the JSON.
- Every figure is a median with its spread (quartiles, min and max, the sample count), never one system's best.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# vLLM's engine core logs its whole config once at start: "Initializing a V1 LLM engine (v0.32.0) with config:
# model='...', ..., dtype=torch.bfloat16, ..., kv_cache_dtype=auto, ...". `\b` keeps kv_cache_dtype out.
_VLLM_ENGINE = re.compile(r"Initializing a V1 LLM engine \(v([^)]+)\) with config: .*?\bdtype=torch\.(\w+)")
# the same line's "enforce_eager=True|False": eager runs vLLM's custom ops one by one, without its torch.compile graph
_VLLM_EAGER = re.compile(r"Initializing a V1 LLM engine .*?\benforce_eager=(True|False)")
_VLLM_NO_PRELOAD = re.compile(r"(lib\w+) is not found in LD_PRELOAD")
# per-request and per-tensor lines that would push what a reader needs (settings, warnings, errors) out of a tail
_VLLM_NOISE = ('"POST /v1/', '"GET /health', "Attempted to load weight")


@dataclass(frozen=True)
class StreamCount:
    """One streamed completion as the client saw it: content-chunk arrival times (seconds, the client's clock)
    and the server's own count of completion tokens (None when it sent no ``usage``)."""

    stamps: list[float]
    completion_tokens: int | None


def read_stream(lines: Iterable[tuple[float, str]]) -> StreamCount:
    """(arrival time, SSE line) pairs → content-chunk times and ``usage.completion_tokens``. A chunk counts as
    content when it has choices (the usage-only chunk that ``include_usage`` adds has none)."""
    stamps: list[float] = []
    tokens: int | None = None
    for at, line in lines:
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices"):
            stamps.append(at)
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            tokens = int(usage["completion_tokens"])
    return StreamCount(stamps, tokens)


def tpot_s(started: float, count: StreamCount) -> dict[str, float]:
    """TTFT (first content chunk) and TPOT = (last chunk − first chunk) / (tokens − 1), tokens from ``usage``."""
    if not count.stamps or count.completion_tokens is None:
        raise ValueError("a stream without content or without usage cannot be timed fairly")
    first, last = count.stamps[0], count.stamps[-1]
    return {"ttft": first - started, "tokens": count.completion_tokens,
            "tpot": (last - first) / max(1, count.completion_tokens - 1)}


@dataclass(frozen=True)
class VllmStart:
    """What vLLM's start-up log says it runs: its version, the model dtype, the preloads it found missing, and
    whether it runs eagerly (``--enforce-eager``: no ``torch.compile``, no CUDA graphs; None: not said)."""

    version: str | None
    dtype: str | None
    missing_preloads: tuple[str, ...]
    eager: bool | None = None


def vllm_start(log: str) -> VllmStart:
    """Parse vLLM's log (its engine-config line and its LD_PRELOAD warnings)."""
    found = _VLLM_ENGINE.search(log)
    missing = tuple(dict.fromkeys(_VLLM_NO_PRELOAD.findall(log)))
    eager = _VLLM_EAGER.search(log)
    return VllmStart(found.group(1) if found else None, found.group(2) if found else None, missing,
                     eager.group(1) == "True" if eager else None)


def log_tail(log: str, lines: int = 40) -> list[str]:
    """The last ``lines`` lines of vLLM's log without its access-log and per-weight lines."""
    return [line for line in log.splitlines() if not any(n in line for n in _VLLM_NOISE)][-lines:]


def prfaas_dtypes(pools: Any) -> list[str]:
    """The KV dtypes of the pools a prfaas router lists on ``/admin/pools`` (the fingerprint's ``dtype``: what the
    engine's cache, hence its forward pass, holds)."""
    entries = pools.get("pools") if isinstance(pools, dict) else None
    fingerprints = [p.get("fingerprint") for p in entries or [] if isinstance(p, dict)]
    return [f["dtype"] for f in fingerprints if isinstance(f, dict) and isinstance(f.get("dtype"), str)]


def preloads(search: Iterable[Path]) -> list[Path]:
    """The libraries vLLM's CPU installation guide says to ``LD_PRELOAD`` (tcmalloc, then Intel's OpenMP), the
    first match of each in ``search`` order; missing ones are left out (the caller records what was used)."""
    chosen: list[Path] = []
    for pattern in ("libtcmalloc_minimal.so.4", "libiomp5.so"):
        for directory in search:
            hit = directory / pattern
            if hit.exists():
                chosen.append(hit)
                break
    return chosen


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds so far of ``pid`` and every live process below it (all their threads)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.Error:
        return total
    for proc in family:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # exited between the listing and the read
            continue
        total += times.user + times.system
    return total


def spread(samples: list[float]) -> dict[str, float | int | None]:
    """Median, quartiles (inclusive method: defined for two samples), min, max and the count."""
    if not samples:
        return {"n": 0, "median": None, "q1": None, "q3": None, "min": None, "max": None}
    q1, q3 = (statistics.quantiles(samples, n=4, method="inclusive")[i] for i in (0, 2)) if len(samples) > 1 \
        else (samples[0], samples[0])
    return {"n": len(samples), "median": statistics.median(samples), "q1": q1, "q3": q3, "min": min(samples),
            "max": max(samples)}
