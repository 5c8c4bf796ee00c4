"""``prfaas serve prefill|decode --engine vllm`` refuses, at once and saying why, what it cannot serve: no vLLM
virtualenv, a model vLLM cannot load from here, an unknown engine. Real ``prfaas serve`` processes; no vLLM
needed (``test_engine_vllm.py`` runs the real thing)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from prfaas.vllm.server import parse_load

SERVE_S = 60.0


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "prfaas", "serve", "decode", "--router", "http://127.0.0.1:9", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=SERVE_S, env={**os.environ, **(env or {})},
                          check=False)


def test_missing_vllm_virtualenv_is_named() -> None:
    done = _serve("--engine", "vllm", env={"PRFAAS_VLLM_PYTHON": "/nonexistent/python"})
    assert done.returncode == 2, done.stderr
    assert "/nonexistent/python is missing" in done.stderr and "make vllm" in done.stderr


@pytest.mark.parametrize(("args", "said"), [
    (("--engine", "vllm", "--model", "tiny-llama"), "exists only in prfaas's engine"),
    (("--engine", "vllm", "--model", "/nonexistent/model"), "Hugging Face model directory"),
    (("--engine", "vlm"), "--engine must be prfaas or vllm"),
])
def test_what_vllm_cannot_serve_is_refused(args: tuple[str, ...], said: str) -> None:
    env = {"PRFAAS_VLLM_PYTHON": sys.executable}  # present, so the model's own check is what refuses
    done = _serve(*args, env=env)
    assert done.returncode == 2 and said in done.stderr, done.stderr


def test_load_is_read_from_vllms_metrics() -> None:
    text = ('# HELP vllm:num_requests_waiting Number of requests waiting.\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')
    load = parse_load(text)
    assert (load.waiting, load.running, load.kv_usage) == (3, 2, 0.25)
