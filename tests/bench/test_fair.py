"""The fairness helpers of the benchmarks: tokens from ``usage``, dtypes read back, preloads, spread (no timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prfaas.bench.fair import log_tail, preloads, prfaas_dtypes, read_stream, spread, tpot_s, vllm_start


def _sse(*chunks: dict[str, object]) -> list[tuple[float, str]]:
    lines = [(float(i), f"data: {json.dumps(c)}") for i, c in enumerate(chunks)]
    return [*lines, (float(len(chunks)), "data: [DONE]")]


def test_tokens_come_from_usage_not_from_chunks() -> None:
    # prfaas's shape: a token whose text is empty is skipped, a closing chunk with empty text is sent, then usage
    stream = _sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, {"choices": [{"text": ""}]},
                  {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 4}})
    count = read_stream(stream)
    assert count.completion_tokens == 4 and count.stamps == [0.0, 1.0, 2.0]  # the usage chunk is no content
    timed = tpot_s(-0.5, count)
    assert timed["tokens"] == 4 and timed["ttft"] == 0.5
    assert timed["tpot"] == pytest.approx(2.0 / 3)  # (last − first) / (tokens − 1), not / (chunks − 1)


def test_a_stream_without_usage_is_refused() -> None:
    with pytest.raises(ValueError, match="usage"):
        tpot_s(0.0, read_stream(_sse({"choices": [{"text": "a"}]})))


VLLM_LOG = """(APIServer pid=1) INFO [api_utils.py:286] non-default args: {'dtype': 'float32'}
(EngineCore pid=2) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/m', \
speculative_config=None, dtype=torch.bfloat16, max_seq_len=2048, enforce_eager=False, kv_cache_dtype=auto, \
device_config=cpu
(Worker pid=3) WARNING [cpu_worker.py:120] libtcmalloc is not found in LD_PRELOAD. For best performance, ...
(Worker pid=3) WARNING [cpu_worker.py:120] libtcmalloc is not found in LD_PRELOAD. For best performance, ...
"""


def test_vllm_log_gives_version_dtype_compilation_and_missing_preloads() -> None:
    start = vllm_start(VLLM_LOG)
    # the engine's own dtype, not the one asked for and not kv_cache_dtype
    assert (start.version, start.dtype, start.missing_preloads) == ("0.32.0", "bfloat16", ("libtcmalloc",))
    assert start.eager is False
    assert vllm_start(VLLM_LOG.replace("enforce_eager=False", "enforce_eager=True")).eager is True
    assert vllm_start("nothing useful").dtype is None and vllm_start("nothing useful").eager is None
    noisy = VLLM_LOG + 'INFO: 127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK\n' * 50
    assert log_tail(noisy, 2) == VLLM_LOG.splitlines()[-2:]


def test_prfaas_dtype_from_admin_pools() -> None:
    pools = {"pools": [{"pool": "k", "fingerprint": {"model": "m", "dtype": "float32"}}, {"pool": "x"}]}
    assert prfaas_dtypes(pools) == ["float32"]
    assert prfaas_dtypes({"error": {}}) == [] and prfaas_dtypes([]) == []


def test_preloads_take_the_first_match_of_each_library(tmp_path: Path) -> None:
    system, venv = tmp_path / "system", tmp_path / "venv"
    for directory, name in ((system, "libtcmalloc_minimal.so.4"), (venv, "libtcmalloc_minimal.so.4"),
                            (venv, "libiomp5.so")):
        directory.mkdir(exist_ok=True)
        (directory / name).touch()
    assert preloads([system, venv]) == [system / "libtcmalloc_minimal.so.4", venv / "libiomp5.so"]
    assert preloads([tmp_path / "none"]) == []


def test_spread_is_median_quartiles_and_range() -> None:
    assert spread([4.0, 1.0, 3.0, 2.0]) == {"n": 4, "median": 2.5, "q1": 1.75, "q3": 3.25, "min": 1.0, "max": 4.0}
    assert spread([5.0])["q1"] == 5.0 and spread([])["median"] is None
