"""plan kv against the KV the real engine holds: exact for codec none, for every built-in model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from prfaas.cli import app
from prfaas.engine import BUILTIN_MODELS
from prfaas.engine.measure import encoded, mla_layout_of, prompt, run_measure
from prfaas.kv import encode_state
from prfaas.kv.frames import FRAME_POOL_BYTES, FramePool
from prfaas.kv.state import ATTENTION_KINDS
from prfaas.plan import plan_from_path

LENGTHS = [1, 37, 200]  # below, inside and past the tiny models' windows and conv kernels


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_plan_matches_measured_bytes(name: str, engines: Any, tmp_path: Path) -> None:
    engine = engines(name)
    config = tmp_path / "config.json"
    config.write_text(engine.config.to_json_string())
    for n in LENGTHS:
        kv = engine.prefill(prompt(n, int(engine.config.vocab_size))).kv
        plan = plan_from_path(config, dtype="float32", mla_layout=mla_layout_of(kv, engine.config))
        assert plan.kv_bytes(n) == kv.nbytes, f"{name} at {n} tokens"
        recurrent = sum(layer.nbytes for layer in kv.layers if layer.kind not in ATTENTION_KINDS)
        assert plan.fixed_bytes == recurrent, name


def test_measure_cli_profile_shape() -> None:
    res = CliRunner().invoke(app, ["measure", "--model", "tiny-llama", "--seq-len", "16,64", "--codec", "none",
                                   "--codec", "int8", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert {"model", "dtype", "hardware", "prefill", "decode", "kv"} <= set(out)
    assert [r["seq_len"] for r in out["prefill"]] == [16, 64]
    assert {(r["seq_len"], r["codec"]) for r in out["kv"]} == {(16, "none"), (64, "none"), (16, "int8"),
                                                              (64, "int8")}
    none = [r for r in out["kv"] if r["codec"] == "none"]
    assert all(r["plan_matches"] for r in none)
    assert all(r["bytes"] > r["tensor_bytes"] for r in none)  # the blob adds header and frames
    assert all(r["phi_kv_gbps"] > 0 for r in out["kv"])
    assert all(r["encode_seconds"] > 0 for r in out["kv"])  # writing the frames, as a prefill instance does


def test_measured_blob_bytes_are_the_whole_blob_as_encode_state_writes_it(engines: Any) -> None:
    kv = engines("tiny-llama").prefill(prompt(40, 1000)).kv
    for codec in ("none", "int8"):
        size, seconds = encoded(kv, codec, FramePool(FRAME_POOL_BYTES))
        assert size == len(encode_state(kv, codec=codec)) and seconds > 0


def test_measure_profile_feeds_capacity(tmp_path: Path) -> None:
    out = run_measure(model="tiny-llama", lengths=[16, 64], codecs=["none"])
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(out))
    res = CliRunner().invoke(app, ["plan", "capacity", "--profile", str(path), "--bandwidth", "1gbit",
                                   "--json"])
    assert res.exit_code == 0, res.output
    cap = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["seq_len"] for r in cap["phi_kv"]] == [16, 64]
