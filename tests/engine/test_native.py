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
from prfaas.engine.attention import KERNEL
from tests.conftest import random_prompt

kernel = native.decode_attention()
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


def test_an_engine_decodes_on_it_and_the_same_tokens_come_out_without_it() -> None:
    on, off = (load_engine("tiny-llama", kernels=k) for k in (True, False))
    layers = [m for m in on.model.modules() if hasattr(m, "num_key_value_groups")]
    assert layers and all(getattr(m, KERNEL) is kernel for m in layers)
    assert not any(hasattr(m, KERNEL) for m in off.model.modules())
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
