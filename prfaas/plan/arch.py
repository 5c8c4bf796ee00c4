"""Which kind of cache each layer holds: read from ``layer_types`` and the older per-family fields.

Generic kinds: ``full`` (MHA/GQA/MQA or MLA), ``sliding``, ``chunked``, ``recurrent`` (linear attention /
SSM / short convolution: which one is decided by the model family, see ``states.py``),
``hybrid`` (attention and a recurrent state in the same layer, Falcon-H1), ``none`` (MLP/MoE-only layers).
"""

from __future__ import annotations

from prfaas.errors import InvalidRequest
from prfaas.plan.hfconfig import Fields

# transformers' layer type names (and their legacy spellings) → generic kind.
_TYPE_KIND = {
    "full_attention": "full", "attention": "full", "global": "full", "global_attention": "full",
    "sliding_attention": "sliding", "local": "sliding", "local_attention": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "recurrent", "mamba": "recurrent", "mamba2": "recurrent", "conv": "recurrent",
    "gated_deltanet": "recurrent", "kda": "recurrent",
    "hybrid": "hybrid",
    "moe": "none", "mlp": "none", "dense": "none",
}
_PATTERN = {"M": "recurrent", "*": "full", "-": "none", "E": "none"}
_RECURRENT_ONLY = {"mamba", "falcon_mamba", "mamba2", "rwkv"}


def layer_kinds(f: Fields) -> list[str]:
    """One generic kind per decoder layer, in order."""
    n = f.num_layers
    kinds = _explicit(f)
    if kinds is None:
        kinds = _family_default(f, n)
    if kinds is None:
        kinds = [_attention_default(f)] * n
    if len(kinds) != n:
        raise InvalidRequest(f"{f.where}: {len(kinds)} layer types for num_hidden_layers={n}")
    return kinds


def _map_types(values: list[str], field: str) -> list[str]:
    out = []
    for i, value in enumerate(values):
        kind = _TYPE_KIND.get(value)
        if kind is None:
            known = ", ".join(sorted(_TYPE_KIND))
            raise InvalidRequest(f"unknown layer type {field}[{i}] = {value!r}; known types: {known}")
        out.append(kind)
    return out


def _explicit(f: Fields) -> list[str] | None:
    for field in ("layer_types", "layers_block_type"):
        if f.has(field):
            return _map_types(f.str_list(field), field)
    if f.has("hybrid_override_pattern"):
        pattern = str(f.raw("hybrid_override_pattern"))
        bad = [(i, c) for i, c in enumerate(pattern) if c not in _PATTERN]
        if bad:
            i, c = bad[0]
            raise InvalidRequest(f"unknown layer type hybrid_override_pattern[{i}] = {c!r}; known: M * - E")
        return [_PATTERN[c] for c in pattern]
    if f.has("attn_type_list"):  # MiniMax-Text-01 / M1 checkpoints: 1 = softmax attention, 0 = lightning
        values = f.int_list("attn_type_list")
        if any(v not in (0, 1) for v in values):
            raise InvalidRequest(f"attn_type_list holds {sorted(set(values))}; "
                                 "only 0 (linear) and 1 (softmax) exist")
        return ["full" if v == 1 else "recurrent" for v in values]
    return None


def _family_default(f: Fields, n: int) -> list[str] | None:
    mt = f.model_type
    if mt in _RECURRENT_ONLY:
        return ["recurrent"] * n
    if mt in ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
        every = f.num("full_attention_interval", 4)
        return ["full" if (i + 1) % every == 0 else "recurrent" for i in range(n)]
    if mt == "jamba":
        period, offset = f.num("attn_layer_period", 8), f.num("attn_layer_offset", 4)
        return ["full" if i % period == offset else "recurrent" for i in range(n)]
    if mt == "bamba":
        idx = set(f.int_list("attn_layer_indices")) if f.has("attn_layer_indices") else set()
        return ["full" if i in idx else "recurrent" for i in range(n)]
    if mt == "falcon_h1":
        return ["hybrid"] * n
    if mt in ("lfm2", "lfm2_moe"):
        idx = set(f.int_list("full_attn_idxs")) if f.has("full_attn_idxs") else set(range(n))
        return ["full" if i in idx else "recurrent" for i in range(n)]
    if mt == "kimi_linear":
        return _kimi_kinds(f, n)
    if mt in ("minimax", "minimax_text_01", "minimax_m1"):
        return ["full" if (i + 1) % 2 else "recurrent" for i in range(n)]
    if mt in ("gemma3", "gemma3_text"):
        every = f.num("sliding_window_pattern", 6)
        return ["sliding" if (i + 1) % every else "full" for i in range(n)]
    if mt in ("gemma2", "cohere2"):
        return ["sliding" if i % 2 == 0 else "full" for i in range(n)]
    if mt == "mimo_v2_flash":
        return ["full" if i == 0 or (i + 1) % 6 == 0 else "sliding" for i in range(n)]
    if mt in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and f.raw("use_sliding_window") is True:
        first = f.num("max_window_layers", n)
        return ["sliding" if f.has("sliding_window") and i >= first else "full" for i in range(n)]
    return None


def _kimi_kinds(f: Fields, n: int) -> list[str]:
    lac = f.raw("linear_attn_config", {})
    if isinstance(lac, dict) and "full_attn_layers" in lac:
        full = {int(i) - 1 for i in lac["full_attn_layers"]}  # 1-indexed in the checkpoint
        return ["full" if i in full else "recurrent" for i in range(n)]
    return ["full" if i and i % 4 == 0 else "recurrent" for i in range(n)]


def _attention_default(f: Fields) -> str:
    """transformers' rule when nothing names the layers: a ``sliding_window`` makes every layer sliding."""
    if f.raw("use_sliding_window") is False:
        return "full"
    if f.has("sliding_window"):
        return "sliding"
    if f.has("attention_chunk_size"):
        return "chunked"
    return "full"
