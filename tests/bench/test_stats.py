"""Metrics, the prfaas transfer view, KV release and verdicts from synthetic records (no server needed)."""

from __future__ import annotations

from prfaas.bench.client import RequestRecord
from prfaas.bench.matrix import Acceptance
from prfaas.bench.stats import percentile, summarize
from prfaas.bench.target import kv_release, sample_sums
from prfaas.bench.verdict import judge


def _record(start: float, ttft: float, route: str = "remote", **prfaas: object) -> RequestRecord:
    ext = {"route": route, "reason": "prompt over the offload threshold", "retries": 0, "transfer_ms": 20.0,
           "kv_bytes": 1000, "kv_id": f"k{start}", **prfaas}
    return RequestRecord(start=start, input_len=8, max_tokens=4, ttft_s=ttft, e2e_s=ttft + 0.3,
                         itl_s=[0.1, 0.1, 0.1], output_tokens=4, prfaas=ext)


def test_percentiles_are_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0


def test_summary_counts_latency_throughput_and_transfers() -> None:
    records = [_record(i, 0.1 + i / 100) for i in range(10)]
    records.append(_record(10, 0.2, route="local", fallback=True, reason="remote prefill failed"))
    records.append(RequestRecord(start=11, input_len=8, max_tokens=4, error="KV_TIMEOUT"))
    m = summarize(records, wall_s=10.0, ttft_goal_s=0.155)
    assert m["requests"] == 12 and m["ok"] == 11 and m["errors"] == {"KV_TIMEOUT": 1}
    assert m["ttft_ms"]["p50"] is not None and m["tpot_ms"]["p50"] == 100.0
    assert m["goodput_rps"] == 0.6  # six requests met the 150 ms TTFT goal
    t = m["transfer"]
    assert t["attempts"] == 12 and t["remote_ok"] == 10 and t["fallbacks"] == 1 and t["degraded"] == 1
    assert t["fallback_kv_ids"] == ["k10"] and "k10" not in t["kv_ids"] and len(t["kv_ids"]) == 10


def test_requests_in_a_fault_window_are_reported_apart() -> None:
    records = [_record(0, 0.1), _record(5, 0.1, route="local", fallback=True)]
    m = summarize(records, wall_s=6.0, windows=[(4.0, 6.0)])
    assert m["transfer"]["success_rate"] == 1.0
    assert m["transfer_in_fault"]["fallbacks"] == 1


def test_kv_release_needs_every_blob_released_in_time() -> None:
    before = {"live_blobs": 0, "records": {}}
    good = {"kv_id": "a", "reason": "released", "created_ms": 0, "deleted_ms": 500}
    after = {"live_blobs": 0, "records": {"a": good}}
    assert kv_release(before, after, ["a"], within_s=1.0)["on_time"]
    late = {"live_blobs": 0, "records": {"a": {**good, "deleted_ms": 5000}}}
    assert not kv_release(before, late, ["a"], within_s=1.0)["on_time"]
    expired = {"live_blobs": 0, "records": {"a": {**good, "reason": "expired"}}}
    assert not kv_release(before, expired, ["a"], within_s=1.0)["on_time"]
    assert not kv_release(before, after, ["a", "b"], within_s=1.0)["on_time"]  # b never ended
    assert kv_release(None, after, ["a"], 1.0) == {"available": False}


def test_kv_release_lets_a_fallback_blob_be_never_stored_or_aborted_but_not_left() -> None:
    """A request that fell back to local prefill may have pushed nothing a store kept (no record anywhere) or
    had its half-written blob aborted: both are clean. Still live, or ended any other way, is not."""
    before = {"live_blobs": 0, "records": {}}
    good = {"kv_id": "a", "reason": "released", "created_ms": 0, "deleted_ms": 500}
    aborted = {"kv_id": "f2", "reason": "aborted", "created_ms": 0, "deleted_ms": 100}
    after = {"live_blobs": 0, "records": {"a": good, "f2": aborted}}
    kv = kv_release(before, after, ["a"], within_s=1.0, fallback_ids=["f1", "f2"])
    assert kv["on_time"] and kv["never_stored"] == 1 and kv["not_ended"] == 0
    assert not kv_release(before, {**after, "live_blobs": 1}, ["a"], 1.0, ["f1", "f2"])["on_time"]
    assert not kv_release(before, after, ["a", "f2"], 1.0, ["f1"])["on_time"]  # served from, so aborted is wrong
    evicted = {"live_blobs": 0, "records": {"a": good, "f2": {**aborted, "reason": "evicted"}}}
    assert not kv_release(before, evicted, ["a"], 1.0, ["f2"])["on_time"]


def test_verdict_uses_the_relative_ttft_sla_and_says_why() -> None:
    metrics = summarize([_record(i, 0.12) for i in range(20)], wall_s=5.0)
    metrics["kv"] = {"available": True, "on_time": True}
    baseline = {"ttft_ms": {"p50": 100.0, "p99": 100.0}}
    assert judge(metrics, Acceptance(ttft_overhead=0.5), baseline)["pass"]
    verdict = judge(metrics, Acceptance(ttft_overhead=0.1), baseline)
    assert verdict["failed"] == ["ttft_p50_ms", "ttft_p99_ms"]
    assert not judge(metrics, Acceptance(ttft_p99_ms=50), None)["pass"]


def test_sample_sums_add_every_label_set() -> None:
    text = ('# TYPE prfaas_x counter\nprfaas_x_total{a="1"} 2.0\nprfaas_x_total{a="2"} 3.0\n'
            'prfaas_x_created{a="1"} 9\nprfaas_y 1\nprfaas_y_other 4 1700000000000\n')
    sums = sample_sums(text)
    assert (sums["prfaas_x_total"], sums["prfaas_y"], sums["prfaas_y_other"]) == (5.0, 1.0, 4.0)


def test_sample_sums_of_text_that_is_not_prometheus_are_empty() -> None:
    assert sample_sums("<html>not metrics</html>\n") == {}
    assert sample_sums("") == {}
