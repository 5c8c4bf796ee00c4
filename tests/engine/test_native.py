from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from prfaas.engine import load_engine, native
from prfaas.engine.attention import KERNEL, PREFILL_KERNEL, _prefill_mask
from tests.conftest import random_prompt

kernel = native.decode_attention()
prefill = native.prefill_attention()
pytestmark = pytest.mark.skipif(kernel is None, reason="prfaas's CPU kernels do not build here")


def _step(rows: int, positions: int, dim: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A decode step's shapes as the batch hands them over: K/V as views of larger in-place buffers, each row's
    left padding masked."""
    g = torch.Generator().manual_seed(seed)
    buffers = [torch.randn(rows + 3, 2, positions + 40, dim, generator=g).to(dtype) for _ in range(2)]
    k, v = (b[:rows, :, :positions] for b in buffers)
    q = torch.randn(rows, 2, 3, dim, generator=g).to(dtype)
    mask = torch.ones(rows, 1, 1, positions, dtype=torch.bool)
    for i in range(rows):
        mask[i, ..., : (7 * i) % (positions - 1)] = False
    return q, k, v, mask


@pytest.mark.parametrize("dim", [16, 64, 128, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_masked_attention(dim: int, dtype: torch.dtype) -> None:
    q, k, v, mask = _step(5, 77, dim, dtype)
    out = kernel(q, k, v, mask[:, 0, 0], dim ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: one rounding of the output
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance)
    unmasked = kernel(q, k, v, None, dim ** -0.5)
    torch.testing.assert_close(unmasked.float(), F.scaled_dot_product_attention(q.float(), k.float(), v.float()),
                               atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_batch_or_its_masked_positions(dtype: torch.dtype) -> None:
    q, k, v, mask = _step(6, 50, 64, dtype)
    together = kernel(q, k, v, mask[:, 0, 0], 0.125)
    for i in range(6):
        start = int((~mask[i, 0, 0]).sum())
        alone = kernel(q[i:i + 1], k[i:i + 1, :, start:], v[i:i + 1, :, start:], None, 0.125)
        assert torch.equal(together[i:i + 1], alone)  # bit for bit
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k.transpose(1, 2)[~mask[:, 0, 0]] = float("nan")  # [rows, positions, heads, dim] views
    poisoned_v.transpose(1, 2)[~mask[:, 0, 0]] = float("inf")
    assert poisoned_k.isnan().any()
    assert torch.equal(kernel(q, poisoned_k, poisoned_v, mask[:, 0, 0], 0.125), together)


def test_the_kernel_refuses_what_it_cannot_compute() -> None:
    q, k, v, mask = _step(2, 9, 64, torch.float32)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel(q, k.bfloat16(), v, None, 0.125)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, None, 0.125)
    with pytest.raises(RuntimeError, match="mask"):
        kernel(q, k, v, mask[:, 0, 0, :4], 0.125)
    with pytest.raises(RuntimeError, match="head dim"):
        kernel(*(t.repeat(1, 1, 1, 5)[..., :300] for t in (q, k, v)), None, 0.125)


def _prefill(batch: int, heads: int, kv_heads: int, queries: int, keys: int, dim: int, dtype: torch.dtype,
             seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A prefill pass's shapes as the model hands them over: q a transposed view of the projection's output."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, queries, heads, dim, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
               causal: bool = False) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal,
                                         enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dim", [16, 64, 128, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (32, 2)])
def test_the_prefill_kernel_computes_causal_and_masked_attention(dim: int, dtype: torch.dtype, heads: int,
                                                                 kv_heads: int) -> None:
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    q, k, v = _prefill(1, heads, kv_heads, 45, 45, dim, dtype)
    out = prefill(q, k, v, None, True, dim ** -0.5)
    assert out.shape == (1, 45, heads, dim) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.float(), _reference(q, k, v, causal=True), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(prefill(q, k, v, None, False, dim ** -0.5).float(), _reference(q, k, v),
                               atol=tolerance, rtol=tolerance)
    # a chunk after a cached prefix, and a left-padded batch: the masks transformers builds for them
    q, k, v = _prefill(2, heads, kv_heads, 20, 53, dim, dtype, seed=1)
    mask = torch.ones(53, 53, dtype=torch.bool).tril()[-20:].repeat(2, 1, 1)
    mask[1, :, :9] = False
    mask[1, 3, 30:] = False  # a hole in a row's keys
    got = prefill(q, k, v, mask, False, dim ** -0.5)
    torch.testing.assert_close(got.float(), _reference(q, k, v, mask[:, None]), atol=tolerance, rtol=tolerance)


def test_a_prefill_rows_result_is_the_same_bits_however_the_pass_is_chunked() -> None:
    q, k, v = _prefill(1, 9, 3, 90, 90, 64, torch.bfloat16)
    whole = prefill(q, k, v, None, True, 0.125)
    causal = torch.ones(90, 90, dtype=torch.bool).tril()
    for start, end in ((0, 17), (17, 50), (50, 90)):
        chunk = prefill(q[:, :, start:end], k[:, :, :end], v[:, :, :end], causal[None, start:end, :end], False, 0.125)
        assert torch.equal(chunk, whole[:, start:end])
    nothing = torch.zeros(1, 90, 90, dtype=torch.bool)
    assert not prefill(q, k, v, nothing, False, 0.125).any()  # a row that attends to nothing gets zeros


def test_the_prefill_kernel_refuses_what_it_cannot_compute_and_the_model_keeps_sdpa_for_it() -> None:
    q, k, v = _prefill(1, 6, 3, 10, 12, 64, torch.float32)
    with pytest.raises(RuntimeError, match="causal"):
        prefill(q, k, v, None, True, 0.125)
    with pytest.raises(RuntimeError, match="mask"):
        prefill(q, k, v, torch.ones(1, 10, 11, dtype=torch.bool), False, 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        prefill(q, k.bfloat16(), v, None, False, 0.125)
    with pytest.raises(RuntimeError, match="kv_heads"):
        prefill(q[:, :5], k, v, None, False, 0.125)
    causal = torch.ones(1, 1, 10, 12, dtype=torch.bool)
    assert _prefill_mask(q, k, v, None, True, 0.0, {}) is False  # SDPA's causal aligns to the first key here
    assert _prefill_mask(q, k, v, causal.float(), False, 0.0, {}) is False
    assert _prefill_mask(q, k, v, causal, False, 0.0, {"sliding_window": 4}) is False
    assert _prefill_mask(q, k, v, causal, False, 0.1, {}) is False
    assert _prefill_mask(q, k, v, None, False, 0.0, {}) is None
    assert _prefill_mask(q, k, v, torch.ones(1, 1, 10, 20, dtype=torch.bool), False, 0.0, {}).shape == (1, 10, 12)


def test_an_engine_decodes_on_it_and_the_same_tokens_come_out_without_it() -> None:
    on, off = (load_engine("tiny-llama", kernels=k) for k in (True, False))
    layers = [m for m in on.model.modules() if hasattr(m, "num_key_value_groups")]
    assert layers and all(getattr(m, KERNEL) is kernel and getattr(m, PREFILL_KERNEL) is prefill for m in layers)
    assert not any(hasattr(m, KERNEL) or hasattr(m, PREFILL_KERNEL) for m in off.model.modules())
    prompt = random_prompt(60, seed=4)
    assert on.generate(prompt, 12) == off.generate(prompt, 12)  # float32: the two kernels agree to ~1e-7


def test_without_a_compiler_the_engine_keeps_pytorchs_kernel_and_says_why(tmp_path: Path) -> None:
    env = {**os.environ, "CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    script = ("import logging; logging.basicConfig(); from prfaas.engine import load_engine; "
              "from prfaas.engine.attention import KERNEL; e = load_engine('tiny-llama'); "
              "print(any(hasattr(m, KERNEL) for m in e.model.modules()))")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert "CPU kernels could not be built" in done.stderr


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_waited_for(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # a build killed an hour ago
    native.clear_stale_lock(tmp_path)
    assert not lock.exists()
    lock.touch()  # a build under way: waited for until it releases its lock
    threading.Timer(1.0, lock.unlink).start()
    started = time.monotonic()
    native.clear_stale_lock(tmp_path, stale_s=60)
    assert 0.9 < time.monotonic() - started < 30


def test_the_build_is_kept_per_python_and_torch_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name, flags = native.build_flags()
    assert name.startswith("prfaas_kernels_") and "-O3" in flags
    directory = native.build_directory(name)
    assert directory.parent.parent == tmp_path and torch.__version__ in directory.parent.name
