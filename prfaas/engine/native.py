"""prfaas's own CPU kernels (``csrc/``), compiled for this machine's instruction set by torch's C++ extension builder.

- ``decode_attention``, the one-token attention of a decode step (``csrc/decode_attention.cpp``). PyTorch's CPU
  flash kernel runs each (row, KV head) of a step as a three-query matrix product through oneDNN, and its per-call
  cost dominates at decode's shapes; the kernel reads each row's keys and values once for all the query heads of
  its group, in float32, skipping the positions the row's mask leaves out.
- ``prefill_attention``, the attention of a pass with more than one query (``csrc/prefill_attention.cpp``): the
  same flash kernel runs a short prompt as small matrix products whose per-call cost outweighs their arithmetic;
  the kernel takes tiles of query rows through blocks of keys with a running softmax, in float32, a mask at the
  causal pass's speed.
- ``rms_norm``, ``silu_mul`` and ``rotary`` (``csrc/layers.cpp``): a Llama-family layer's RMSNorm, SiLU-and-multiply
  and rotary embedding as one operator each where transformers runs several (``fused.py`` puts them in).

``benchmarks/engine_profile.py`` times a step and a prefill with and without them. All are ``torch.ops.prfaas``
operators of one library.

The first use on a machine builds the library into torch's extension cache (``TORCH_EXTENSIONS_DIR``, else
``~/.cache/torch_extensions``, a folder per Python and torch version: 10-30 s on 2 cores, once per source and
instruction set; ``make`` builds it at set-up, with ``main``); every later process loads the cached library. Where
it cannot be built (no C++ compiler or ninja, a failed build), the engine logs why once and keeps PyTorch's
operators.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("prfaas.engine")

SOURCES = tuple(Path(__file__).resolve().parent / "csrc" / name
                for name in ("decode_attention.cpp", "prefill_attention.cpp", "layers.cpp"))
MAX_HEAD_DIM = 256  # the largest head dim it takes (64 and 128 are compiled for their size)
# Instruction-set flags by torch's own reading of the CPU (``torch.backends.cpu.get_cpu_capability``); the build's
# name carries the capability, so machines of different kinds sharing a cache never load each other's build.
_X86_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

STALE_LOCK_S = 120.0  # a build takes 10-30 s on 2 cores; a lock this old was left by a killed build

DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor]
PrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool, float], torch.Tensor]


def build_flags() -> tuple[str, list[str]]:
    """The build's name and compiler flags for this CPU."""
    capability = torch.backends.cpu.get_cpu_capability()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = ["-O3", "-fopenmp", *(_X86_FLAGS.get(capability, []) if x86 else [])]
    return f"prfaas_kernels_{capability.lower()}", flags


def build_directory(name: str) -> Path:
    """Where ``name`` is built: torch's extension cache, one folder per Python and torch version (an extension is
    built against one torch)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return root / f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}" / name


def clear_stale_lock(directory: Path, stale_s: float = STALE_LOCK_S) -> None:
    """Wait while another process builds in ``directory`` (torch's builder holds its ``lock`` file), and remove a
    lock older than ``stale_s``: one left by a process killed while building, which torch's builder would wait on
    for ever."""
    lock = directory / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_s:
            log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.5)


@functools.cache
def library() -> bool:
    """Build (or find) and load the kernels' library; False (logged once) where it cannot be built here. Cached per
    process, as an import is."""
    name, flags = build_flags()
    try:
        from torch.utils.cpp_extension import load

        directory = build_directory(name)
        directory.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(directory)
        load(name=name, sources=[str(source) for source in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
             build_directory=str(directory), is_python_module=False, verbose=False)
    except Exception as exc:  # a missing compiler or ninja, a failed build: PyTorch's operators stay
        reason = (str(exc).strip().splitlines() or [""])[-1]
        log.warning("prfaas's CPU kernels could not be built (%s: %s); the engine runs on PyTorch's operators "
                    "alone", type(exc).__name__, reason)
        return False
    return True


def decode_attention() -> DecodeAttention | None:
    """The compiled ``decode_attention(q, k, v, mask, scale)``, or None where the library cannot be built here."""
    if not library():
        return None
    kernel: DecodeAttention = torch.ops.prfaas.decode_attention
    return kernel


def prefill_attention() -> PrefillAttention | None:
    """The compiled ``prefill_attention(q, k, v, mask, causal, scale)``, or None where the library cannot be built
    here."""
    if not library():
        return None
    kernel: PrefillAttention = torch.ops.prfaas.prefill_attention
    return kernel


def main() -> int:
    """Build (or find) the kernels for this machine; exit 1 where they cannot be built."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.monotonic()
    name, flags = build_flags()
    if not library():
        return 1
    print(f"{name}: ready in {time.monotonic() - started:.1f} s ({' '.join(flags)})")
    return 0

