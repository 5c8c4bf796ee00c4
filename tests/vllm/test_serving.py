"""``prfaas serve prefill|decode --engine vllm`` refuses, at once and saying why, what it cannot serve: no vLLM
virtualenv, a model vLLM cannot load from here, an unknown engine. Real ``prfaas serve`` processes; no vLLM
needed (``test_engine_vllm.py`` runs the real thing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prfaas.events import Done, Stages, Token, generate_event
from prfaas.messages import MAX_TCP_PEERS, GenerateRequest, SamplingParams, TcpPeer
from prfaas.vllm.server import LaunchSpec, VllmServer, parse_load, read_tcp_peers
from prfaas.vllm.serving import known_first, recomputed_tokens

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


def test_a_bad_eager_setting_is_refused_and_eager_is_vllms_own_choice_unless_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    done = _serve("--engine", "vllm", env={"PRFAAS_VLLM_PYTHON": sys.executable, "PRFAAS_VLLM_EAGER": "yes"})
    assert done.returncode == 2 and "PRFAAS_VLLM_EAGER must be 0 or 1, not 'yes'" in done.stderr, done.stderr
    monkeypatch.setenv("PRFAAS_VLLM_PYTHON", sys.executable)
    monkeypatch.delenv("PRFAAS_VLLM_EAGER", raising=False)
    server = VllmServer(LaunchSpec("/m", "m", "float32", "kv_consumer"))
    try:
        assert "--enforce-eager" not in server.command()  # vLLM's default: its compiled graph
        monkeypatch.setenv("PRFAAS_VLLM_EAGER", "1")
        assert "--enforce-eager" in server.command()
    finally:
        server.stop()  # its scratch directory goes


def test_load_is_read_from_vllms_metrics() -> None:
    text = ('# HELP vllm:num_requests_waiting Number of requests waiting.\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')
    load = parse_load(text)
    assert (load.waiting, load.running, load.kv_usage) == (3, 2, 0.25)


def test_the_connectors_tcp_figures_are_read_strictly_and_kept_when_unreadable(tmp_path: Path) -> None:
    path, last = tmp_path / "tcp_peers.json", [TcpPeer("10.0.0.1:9000", 1.0, 0)]
    assert read_tcp_peers(str(path), last) == last  # none written yet
    path.write_text(json.dumps([{"peer": "10.0.0.2:9000", "rtt_ms": 25.5, "retransmits": 3}]))
    assert read_tcp_peers(str(path), last) == [TcpPeer("10.0.0.2:9000", 25.5, 3)]
    for bad in ("{", json.dumps({"peer": "x"}), json.dumps([{"peer": "x", "rtt_ms": -1}])):
        path.write_text(bad)
        assert read_tcp_peers(str(path), last) == last
    path.write_text(json.dumps([{"peer": f"10.0.0.{i}:9000"} for i in range(MAX_TCP_PEERS + 4)]))
    kept = read_tcp_peers(str(path), [])
    assert len(kept) == MAX_TCP_PEERS and kept[0].peer == "10.0.0.4:9000"  # the ones used last


def test_a_recomputed_prompt_is_counted_from_vllms_usage() -> None:
    """vLLM's final usage (``--enable-prompt-tokens-details``) says how many prompt tokens it restored; the rest
    but the last one (always computed) it recomputed, and decode's ``done`` tells the router so."""
    assert recomputed_tokens({"prompt_tokens": 341, "prompt_tokens_details": {"cached_tokens": 340}}) == 0
    assert recomputed_tokens({"prompt_tokens": 341, "prompt_tokens_details": {"cached_tokens": 0}}) == 340
    assert recomputed_tokens({"prompt_tokens": 341}) == 0  # a vLLM that does not say: taken as restored
    done = generate_event(Done(finish_reason="length", completion_tokens=8, recomputed=340).encode())
    assert isinstance(done, Done) and done.recomputed == 340


FAST = {"request_id": "r", "token_ids": [5, 6, 7], "max_tokens": 4, "kv_id": "k", "kv_address": "127.0.0.1:1",
        "first_token": 42, "first_text": " yes", "kv_tokens": 3}


def test_prefills_first_token_is_streamed_at_once_only_where_it_is_exact() -> None:
    assert known_first(GenerateRequest(**FAST)) == Token(token=42, text=" yes", stages=Stages(decode_ms=0.0))
    for change in ({"first_token": -1}, {"kv_id": ""}, {"kv_tokens": 2},  # not known; local; blob short of it
                   {"stop": ["\n"]}, {"sampling": SamplingParams(temperature=0.7, seed=1)}, {"step_offset": 2},
                   {"first_text": " caf\ufffd"}):
        assert known_first(GenerateRequest(**{**FAST, **change})) is None, change
