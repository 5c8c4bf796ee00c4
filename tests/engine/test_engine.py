from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from prfaas.engine import load_engine
from prfaas.engine.loader import native_dtype, resolve_device
from prfaas.engine.worker import DecodeWorker
from prfaas.errors import InvalidRequest, KVBadFormat, KVIncompatible
from prfaas.kv import decode_state, encode_state
from tests.conftest import random_prompt

HYBRID_KINDS = {
    "tiny-llama": {"full_attention"},
    "tiny-qwen3-next": {"linear_attention", "full_attention"},
    "tiny-bamba": {"mamba", "full_attention"},
    "tiny-lfm2": {"conv", "full_attention"},
    "tiny-gemma3": {"sliding_attention", "full_attention"},
    "tiny-kimi-linear": {"linear_attention", "mla"},
    "tiny-minimax": {"cache_state", "full_attention"},
}


@pytest.mark.parametrize("name", HYBRID_KINDS)
def test_layer_kinds_and_fixed_state(engines, name: str) -> None:
    engine = engines(name)
    short, long = (engine.prefill(random_prompt(n)).kv for n in (100, 300))
    assert {layer.kind for layer in short.layers} - {"none"} == HYBRID_KINDS[name]
    assert short.fixed_bytes == long.fixed_bytes  # fixed-size states do not grow with the prompt
    for a, b in zip(short.layers, long.layers, strict=True):
        assert (a.nbytes < b.nbytes) == a.grows


def test_sliding_window_is_capped(engines) -> None:
    engine = engines("tiny-gemma3")
    kv = engine.prefill(random_prompt(500)).kv
    sliding = [x for x in kv.layers if x.kind == "sliding_attention"]
    assert all(x.window == 64 and x.tensors["keys"].shape[-2] < 64 for x in sliding)


def test_layers_stream_during_prefill(engines) -> None:
    engine = engines("tiny-qwen3-next")
    seen = []
    out = engine.prefill(random_prompt(200), on_layer=seen.append)
    assert [x.index for x in seen] == list(range(engine.num_layers))
    for streamed, final in zip(seen, out.kv.layers, strict=True):
        assert streamed.tensors.keys() == final.tensors.keys()
        assert all(np.array_equal(streamed.tensors[k], final.tensors[k]) for k in final.tensors)


def test_fingerprint_mismatch_is_refused_with_field_names(engines) -> None:
    engine = engines("tiny-llama")
    out = engine.prefill(random_prompt(30))
    forged = dataclasses.replace(out.kv, fingerprint=dataclasses.replace(engine.fingerprint, weights="0" * 16))
    with pytest.raises(KVIncompatible, match="weights"):
        engine.decode(forged, out.next_token)
    with DecodeWorker("tiny-lfm2") as other, pytest.raises(KVIncompatible, match=r"arch.*weights"):
        other.decode(encode_state(out.kv), out.next_token, 4)


def test_bfloat16_engine_is_a_different_fingerprint(engines) -> None:
    fp32 = engines("tiny-llama")
    bf16 = load_engine("tiny-llama", dtype="bfloat16")
    assert bf16.fingerprint.mismatches(fp32.fingerprint) == ["weights", "dtype"]
    ids = random_prompt(40)
    out = bf16.prefill(ids)
    kv = decode_state(encode_state(out.kv))
    assert kv.layers[0].tensors["keys"].dtype.name == "bfloat16"
    assert [out.next_token, *bf16.decode(kv, out.next_token, 7)] == bf16.generate(ids, 8)


def test_auto_dtype_is_bfloat16_only_where_it_is_native(engines, monkeypatch) -> None:
    assert load_engine("tiny-llama", dtype="auto").fingerprint.dtype == native_dtype()
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert native_dtype() == "float32"  # a CPU engine, whether or not this machine has a GPU
    assert native_dtype("cuda") == "bfloat16"
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert native_dtype() == ("bfloat16" if torch.backends.mkldnn.is_available() else "float32")


def test_devices_are_checked_before_anything_loads() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("tpu", "gpu0", "", "cuda:x"):
        with pytest.raises(InvalidRequest, match="device must be cpu, cuda, cuda:N or auto"):
            load_engine("tiny-llama", device=bad)
    if torch.cuda.is_available():
        with pytest.raises(InvalidRequest, match="GPU"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(InvalidRequest, match="sees no CUDA GPU"):
            load_engine("tiny-llama", device="cuda")


def test_engines_run_on_the_device_they_were_given(engines) -> None:
    """KV is device-neutral: a prefill on the test device (``PRFAAS_TEST_DEVICE``) restores on the CPU and decodes
    there; on the CPU itself the tokens equal the CPU's own ``generate`` (across devices they follow each device's
    kernels, so only the decode is checked)."""
    here = engines("tiny-llama")
    cpu = load_engine("tiny-llama", device="cpu")
    assert cpu.device.type == "cpu" and here.fingerprint == cpu.fingerprint
    ids = random_prompt(60)
    out = here.prefill(ids)
    assert all(t.device.type == here.device.type for t in here.model.parameters())
    kv = decode_state(encode_state(out.kv))
    tokens = cpu.decode(kv, out.next_token, 8)
    assert len(tokens) == 8
    if here.device.type == "cpu":
        assert [out.next_token, *tokens] == cpu.generate(ids, 9)


POOL_LEFT = """
import os, sys, time
import torch
from prfaas.engine import loader
before = set(os.listdir("/proc/self/task"))
if sys.argv[1] == "here":
    engine = loader._load_engine("tiny-llama", "float32", None, True, "cpu", True)
    _ = engine.layer_table, engine.kv_footprint
else:
    engine = loader.load_engine("tiny-llama")
deadline = time.monotonic() + 10  # a pool's threads end shortly after the thread that owned it
while set(os.listdir("/proc/self/task")) - before and time.monotonic() < deadline:
    time.sleep(0.05)
print(torch.get_num_threads(), len(set(os.listdir("/proc/self/task")) - before))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_loading_leaves_the_calling_thread_no_openmp_pool() -> None:
    """What a load runs in parallel (packing, hashing, the two tiny prefills a service reads) must leave no OpenMP
    pool on the caller's thread: a service's engine thread then owns the process's only one (loader.py says why).
    The same load on the calling thread is the control: there it leaves the pool's threads running."""
    def left(where: str) -> tuple[int, int]:
        done = subprocess.run([sys.executable, "-c", POOL_LEFT, where], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        threads, extra = done.stdout.split()
        return int(threads), int(extra)

    threads, here = left("here")
    if threads < 2:
        pytest.skip("torch runs one thread here: no pool to leave")
    assert here >= 1, "the control left no pool: the check would not see one"
    assert left("passing") == (threads, 0)


def test_bad_prompts_are_clear_errors(engines) -> None:
    engine = engines("tiny-llama")
    with pytest.raises(InvalidRequest, match="empty"):
        engine.prefill([])
    with pytest.raises(InvalidRequest, match="context is 8192"):
        engine.prefill([5] * 8193)
    with pytest.raises(InvalidRequest, match=r"token ids must be in \[0, 49152\)"):
        engine.prefill([49152])


def test_unknown_model_names_the_choices() -> None:
    with pytest.raises(InvalidRequest, match="tiny-llama"):
        load_engine("no-such-model")
    with pytest.raises(InvalidRequest, match="dtype"):
        load_engine("tiny-llama", dtype="int3")


def test_layer_count_mismatch_is_bad_format(engines) -> None:
    engine = engines("tiny-llama")
    kv = engine.prefill(random_prompt(10)).kv
    with pytest.raises(KVBadFormat, match="layers"):
        engine.decode(dataclasses.replace(kv, layers=kv.layers[:1]), 5)


def test_loads_a_hugging_face_directory(engines, tmp_path) -> None:
    engine = engines("tiny-lfm2")
    engine.model.save_pretrained(tmp_path)
    engine.tokenizer.save_pretrained(tmp_path)
    again = load_engine(str(tmp_path))
    assert again.fingerprint.mismatches(engine.fingerprint) == []
    ids = random_prompt(64)
    out = engine.prefill(ids)
    assert again.decode(out.kv, out.next_token, 6) == engine.decode(out.kv, out.next_token, 6)


def test_loads_a_gguf_file(engines) -> None:
    from prfaas.engine.models import smollm2_gguf

    engine = load_engine(str(smollm2_gguf()))
    assert engine.fingerprint.mismatches(engines("smollm2-135m").fingerprint) == []
