"""``benchmarks/multiturn_lab.py``'s tables from its per-request records: a turn's row aggregates the
conversations, the answers are compared with the run without the cache, and the goals hold only when, from the
third turn on, TTFT P50 is at least 2x lower than without the cache and WAN bytes grow with the new tokens, not
with the history. (The benchmark itself needs root, the lab and two real deployments per model and mode: over a
minute even in ``--quick``, so it is not run here.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    name = "multiturn_lab_bench"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "multiturn_lab.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def _request(cache_mb: int, turn: int, conversation: int, ttft_ms: float, wan_bytes: int,
             text: str = "same") -> dict[str, Any]:
    prompt = 40 * turn
    return {"model": "m", "mode": "relay", "cache_mb": cache_mb, "turn": turn, "conversation": conversation,
            "prompt_tokens": prompt, "new_tokens": 40, "computed_tokens": 40 if cache_mb else prompt,
            "kv_bytes": wan_bytes, "wan_bytes": wan_bytes, "error": None, "route": "remote", "text": text,
            "ttft_ms": ttft_ms, "router_ttft_ms": ttft_ms, "prefill_ms": None, "transfer_ms": None,
            "restore_ms": None}


def _chat(history_bytes: bool) -> list[dict[str, Any]]:
    """Two conversations of four turns: uncached TTFT and WAN bytes grow with the prompt; cached TTFT is flat,
    and its WAN bytes are flat too unless ``history_bytes`` (the whole prompt's KV shipped)."""
    out = []
    for turn in range(1, 5):
        for conv in range(2):
            prompt_bytes = 1000 * 40 * turn
            out.append(_request(0, turn, conv, 100.0 * turn + conv, prompt_bytes))
            out.append(_request(64, turn, conv, 40.0 + conv, prompt_bytes if history_bytes else 40_000,
                                "other" if (turn, conv) == (4, 1) else "same"))
    return out


def test_a_row_aggregates_a_turn_and_compares_answers_with_the_uncached_run() -> None:
    rows = {(r["cache_mb"], r["turn"]): r for r in _bench().rows(_chat(history_bytes=False))}
    assert len(rows) == 8
    cached = rows[(64, 2)]
    assert (cached["requests"], cached["failed"], cached["remote"], cached["local"]) == (2, 0, 2, 0)
    assert (cached["prompt_tokens"], cached["computed_tokens"], cached["ttft_p50_ms"]) == (80, 40, 40.0)  # nearest rank
    assert cached["answers_equal"] is True and rows[(64, 4)]["answers_equal"] is False
    assert rows[(0, 2)]["answers_equal"] is None  # the uncached run is the reference


def test_the_goals_need_flat_wan_bytes_and_half_the_ttft_from_the_third_turn() -> None:
    bench = _bench()
    met = bench.goals(bench.rows(_chat(history_bytes=False)))
    assert [g["turn"] for g in met] == [3, 4]
    assert all(g["ttft_goal_met"] and g["wan_goal_met"] and g["kv_goal_met"] for g in met)
    assert met[1]["ttft_speedup"] == 10.0
    assert (met[1]["wan_vs_turn2"], met[1]["new_vs_turn2"], met[1]["prompt_vs_turn2"]) == (1.0, 1.0, 2.0)
    grown = bench.goals(bench.rows(_chat(history_bytes=True)))  # the whole prompt's KV: bytes follow the history
    assert all(g["ttft_goal_met"] for g in grown)
    assert not any(g["wan_goal_met"] or g["kv_goal_met"] for g in grown)
    slow = [r if r["cache_mb"] == 0 or r["turn"] != 3 else {**r, "ttft_ms": r["ttft_ms"] * 5}
            for r in _chat(history_bytes=False)]
    assert [g["ttft_goal_met"] for g in bench.goals(bench.rows(slow))] == [False, True]
