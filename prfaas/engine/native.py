"""prfaas's own CPU kernels (``csrc/``), compiled for this machine's instruction set by torch's C++ extension builder.

One kernel so far: ``decode_attention``, the one-token attention of a decode step (``csrc/decode_attention.cpp``).
PyTorch's CPU flash kernel runs each (row, KV head) of a step as a three-query matrix product through oneDNN, and
its per-call cost dominates at decode's shapes; the kernel reads each row's keys and values once for all the query
heads of its group, in float32, skipping the positions the row's mask leaves out (``benchmarks/engine_profile.py``
times a step with and without it).

The first use on a machine builds it into torch's extension cache (``TORCH_EXTENSIONS_DIR``, else
``~/.cache/torch_extensions``: about 10 s on 2 cores, once per source and instruction set; ``make`` builds it at
set-up, with ``main``); every later process loads the cached library. Where it cannot be
built (no C++ compiler, a CPU other than x86 without a build), the engine logs why once and keeps PyTorch's kernel.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("prfaas.engine")

SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_attention.cpp"
MAX_HEAD_DIM = 256  # the largest head dim it takes (64 and 128 are compiled for their size)
# Instruction-set flags by torch's own reading of the CPU (``torch.backends.cpu.get_cpu_capability``); the build's
# name carries the capability, so machines of different kinds sharing a cache never load each other's build.
_X86_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor]


def build_flags() -> tuple[str, list[str]]:
    """The build's name and compiler flags for this CPU."""
    capability = torch.backends.cpu.get_cpu_capability()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = ["-O3", "-fopenmp", *(_X86_FLAGS.get(capability, []) if x86 else [])]
    return f"prfaas_decode_attention_{capability.lower()}", flags


@functools.cache
def decode_attention() -> DecodeAttention | None:
    """The compiled ``decode_attention(q, k, v, mask, scale)``, or None (logged) where it cannot be built here.
    Cached per process, as an import is."""
    name, flags = build_flags()
    try:
        from torch.utils.cpp_extension import load

        load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
    except Exception as exc:  # a missing compiler or ninja, a failed build: PyTorch's kernel stays
        log.warning("prfaas's decode attention kernel could not be built (%s: %s); decode steps use PyTorch's "
                    "scaled_dot_product_attention", type(exc).__name__, str(exc).strip().splitlines()[-1:])
        return None
    kernel: DecodeAttention = torch.ops.prfaas.decode_attention
    return kernel


def main() -> int:
    """Build (or find) the kernel for this machine; exit 1 where it cannot be built."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.monotonic()
    kernel = decode_attention()
    name, flags = build_flags()
    if kernel is None:
        return 1
    print(f"{name}: ready in {time.monotonic() - started:.1f} s ({' '.join(flags)})")
    return 0

