"""Tiny hybrid models for the vLLM tests, built from a config with random weights (nothing downloaded), with the
embedded SmolLM2's tokenizer so that vLLM's server can tokenise: Gemma3 (sliding-window and full attention layers)
and GraniteMoeHybrid (Mamba2 and attention layers)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# SmolLM2's tokenizer: the embedding must cover its ids, and bos/eos/pad must be its own.
_VOCAB = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
# Weights larger than the default initialisation, so that the next token depends on the whole context
# (near-uniform logits would make greedy tokens equal by chance).
_INIT = 0.08

GEMMA3_WINDOW = 64  # well under the tests' prompts: most of a sliding layer's blocks fall outside the window
GEMMA3: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "query_pre_attn_scalar": 64, "num_hidden_layers": 6, "sliding_window": GEMMA3_WINDOW,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 4096,
}
GRANITE_HYBRID: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 256, "shared_intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 4, "max_position_embeddings": 4096,
    "layer_types": ["mamba", "attention", "mamba", "mamba"], "num_local_experts": 4, "num_experts_per_tok": 2,
    "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_state": 64, "mamba_n_groups": 1, "mamba_expand": 2,
    "mamba_d_conv": 4, "mamba_chunk_size": 64, "position_embedding_type": "rope",
}


def build(model_type: str, overrides: dict[str, Any], out: Path) -> Path:
    """Save a random-weight ``model_type`` model with ``overrides`` (fp32) and SmolLM2's tokenizer into ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from prfaas.engine import models

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**overrides, **_VOCAB, "initializer_range": _INIT})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer = models.smollm2_dir()
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)
    return out
