"""``load_engine``: a built-in name, a Hugging Face directory or a ``.gguf`` file → ``TransformersEngine``; a
``synthetic-*`` name → ``SyntheticEngine`` (both ``EngineBase``, the ``Engine`` protocol)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import xxhash

from prfaas.engine import attention, models, native
from prfaas.engine.base import EngineBase
from prfaas.engine.cache import to_numpy
from prfaas.engine.engine import TransformersEngine
from prfaas.engine.fused import fuse
from prfaas.engine.packed import pack
from prfaas.errors import InvalidRequest
from prfaas.kv import Fingerprint
from prfaas.kv.fingerprint import tokenizer_hash

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
T = TypeVar("T")


def load_engine(spec: str = models.SMOLLM2, dtype: str = "float32", threads: int | None = None,
                packed: bool = True, device: str = "cpu", kernels: bool = True) -> EngineBase:
    """Load a model for prefill and decode on ``device`` (``cpu``, ``cuda``, ``cuda:N``, or ``auto``: the GPU where
    torch sees one); ``packed``: on the CPU, its linear layers on weights prepacked for oneDNN (``packed.py``; off
    only to measure what packing gains); ``kernels``: on the CPU, prfaas's own kernels where they build: decode
    attention, and Llama-family layers on merged projections and fused operators (``native.py``, ``fused.py``; off
    only to measure what they gain). The fingerprint does not name the device: KV made on
    a GPU restores on a CPU of the same dtype and back (the tokens then follow each device's kernels, not bit for
    bit).

    The load, and the two tiny prefills behind ``layer_table`` and ``kv_footprint`` (a service reads both as it
    starts), run on a thread of their own that ends with them (``on_passing_thread``): the caller's thread is left
    without an OpenMP pool, and the thread that then runs the engine owns the process's only one."""
    def load() -> EngineBase:
        engine = _load_engine(spec, dtype, threads, packed, device, kernels)
        _ = engine.layer_table, engine.kv_footprint
        return engine

    return on_passing_thread(load)


def on_passing_thread(work: Callable[[], T]) -> T:
    """``work()`` on a new thread that ends when it returns; its result, or its exception raised here.

    Why: every thread that runs a parallel torch operator keeps an OpenMP pool of its own (torch's CPU wheel uses
    GNU OpenMP) for as long as it lives, and libgomp cuts the spin-wait of every pool to almost nothing once the
    process has more pool threads than cores: each operator then waits for its threads to wake, and a service that
    loaded its model on the main thread and ran it on its engine thread stepped at about half speed
    (docs/engine.md). A pool ends with its thread."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # handed to the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name="prfaas-load", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _load_engine(spec: str, dtype: str, threads: int | None, packed: bool, device: str,
                 kernels: bool) -> EngineBase:
    if spec.startswith("synthetic-"):  # KV sizes and timings of a large model, no weights (synthetic.py)
        from prfaas.engine.synthetic import load_synthetic

        return load_synthetic(spec)
    target = resolve_device(device)
    if dtype == "auto":
        dtype = native_dtype(target.type)
    if dtype not in DTYPES:
        raise InvalidRequest(f"dtype must be one of {', '.join(DTYPES)} or auto, not {dtype!r}")
    if threads:
        torch.set_num_threads(threads)
    _quiet_transformers()
    attention.install()
    model, tokenizer, name, root = _load(spec, DTYPES[dtype])
    model.eval()
    fingerprint = _fingerprint(model, tokenizer, name, dtype)  # over the weights as loaded, before packing
    if target.type != "cpu":
        model.to(target)
    else:
        if kernels and native.library():
            fuse(model)
            attention.use_kernel(model, native.decode_attention(), native.prefill_attention())
        if packed:
            pack(model)
    return TransformersEngine(model, tokenizer, name, fingerprint, root=str(root))


def resolve_device(device: str) -> torch.device:
    """``device`` as torch names it; ``auto`` is the first GPU where torch sees one, else the CPU. ``InvalidRequest``
    for a name torch does not know or a GPU this process cannot use."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidRequest(f"device must be cpu, cuda, cuda:N or auto, not {device!r}") from exc
    if target.type == "cpu":
        return target
    if target.type != "cuda":
        raise InvalidRequest(f"device must be cpu, cuda, cuda:N or auto, not {device!r}")
    if not torch.cuda.is_available():
        raise InvalidRequest(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA GPU")
    if target.index is not None and target.index >= torch.cuda.device_count():
        raise InvalidRequest(f"device {device!r}: torch sees {torch.cuda.device_count()} GPU(s)")
    return target


def native_dtype(device: str = "cpu") -> str:
    """What ``auto`` means on ``device`` (a torch device type): ``bfloat16`` on a GPU or where the CPU multiplies it
    natively (oneDNN's bf16 path: AVX-512 BF16, AMX, Arm BF16), else ``float32``. Without that support bfloat16 is
    emulated: on an AVX2-only CPU a matmul ran at 1.4 GFLOP/s in bfloat16 against 67.8 in float32
    (``benchmarks/matmul_dtype.py``)."""
    if device != "cpu":
        return "bfloat16"
    native = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return "bfloat16" if native else "float32"


def _quiet_transformers() -> None:
    """Progress bars and fallback-kernel notices are noise in a service's log."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def _load(spec: str, dtype: torch.dtype) -> tuple[Any, Any, str, Path]:
    """The model, its tokenizer, its served name and the directory the tokenizer came from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec in models.TINY_MODELS:
        config = models.tiny_config(spec)
        with torch.random.fork_rng():
            torch.manual_seed(models.TINY_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tokenizer_dir = models.smollm2_dir()
        return model.to(dtype), AutoTokenizer.from_pretrained(tokenizer_dir), spec, tokenizer_dir
    path = Path(spec).expanduser()
    if spec == models.SMOLLM2:
        directory, name = models.smollm2_dir(), spec
    elif path.suffix == ".gguf" and path.is_file():
        directory, name = models.converted_gguf(path.resolve(), _gguf_name(path)), path.stem
    elif (path / "config.json").is_file():
        directory, name = path, path.resolve().name
    else:
        raise InvalidRequest(f"unknown model {spec!r}: give a built-in name ({', '.join(models.BUILTIN_MODELS)}), "
                             "a Hugging Face model directory or a .gguf file")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    return model, AutoTokenizer.from_pretrained(directory), name, directory.resolve()


def _gguf_name(path: Path) -> str:
    stat = path.stat()
    tag = xxhash.xxh64_hexdigest(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())[:8]
    return f"gguf-{path.stem}-{tag}"


def _fingerprint(model: Any, tokenizer: Any, name: str, dtype: str) -> Fingerprint:
    config = model.config.get_text_config(decoder=True)
    return Fingerprint(model=name, arch=str(config.model_type), weights=weights_hash(model),
                       tokenizer=tokenizer_hash(tokenizer), dtype=dtype,
                       max_seq_len=int(config.max_position_embeddings))


def weights_hash(model: Any) -> str:
    """xxHash64 over every parameter and buffer, by name, in the loaded dtype."""
    digest = xxhash.xxh64()
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(to_numpy(tensor).view(np.uint8).reshape(-1).data)
    return digest.hexdigest()
