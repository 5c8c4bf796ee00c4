"""plan kv against hand-computed sizes of published configs (bf16 unless said; B = bytes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prfaas.errors import InvalidRequest
from prfaas.plan import plan_from_config, plan_from_path

FIX = Path(__file__).parent / "fixtures"


def plan(name: str, **kw: object):  # type: ignore[no-untyped-def]
    return plan_from_path(FIX / name, **kw)


# (fixture, bytes per token, fixed bytes, {kind: count}) — each worked out by hand in the comment.
CASES = [
    # 32 layers × 2 (K,V) × 8 KV heads × 128 × 2 B
    ("llama-3.1-8b-instruct.json", 32 * 2 * 8 * 128 * 2, 0, {"full_attention": 32}),
    # 16 layers × 2 × 8 × 64 × 2 B
    ("llama-3.2-1b.json", 16 * 2 * 8 * 64 * 2, 0, {"full_attention": 16}),
    # 36 × 2 × 8 × 128 × 2 B
    ("qwen3-8b.json", 36 * 2 * 8 * 128 * 2, 0, {"full_attention": 36}),
    # 12 full layers × 2 × 2 × 256 × 2 B; 36 GDN layers × ((2·16·128 + 32·128)·4 + 32·128·128) × 2 B
    ("qwen3-next-80b-a3b-instruct.json", 12 * 2 * 2 * 256 * 2, 36 * (8192 * 4 + 524288) * 2,
     {"full_attention": 12, "gated_deltanet": 36}),
    # 15 full × 2 × 2 × 256 × 2 B; 45 GDN × ((2·16·128 + 64·128)·4 + 64·128·128) × 2 B
    ("qwen3.5-397b-a17b.json", 15 * 2048, 45 * (12288 * 4 + 1048576) * 2,
     {"full_attention": 15, "gated_deltanet": 45}),
    # 7 MLA layers × (512 + 64) × 2 B; 20 KDA × (3·32·128·4 + 32·128·128) × 2 B
    ("kimi-linear-48b-a3b-instruct.json", 7 * 576 * 2, 20 * (49152 + 524288) * 2, {"mla": 7, "kda": 20}),
    # 61 MLA layers × 576 × 2 B
    ("deepseek-v3.json", 61 * 576 * 2, 0, {"mla": 61}),
    # 10 softmax × 2 × 8 × 128 × 2 B; 70 lightning × 64 × 128 × 128 × 2 B
    ("minimax-text-01.json", 10 * 4096, 70 * 64 * 128 * 128 * 2, {"full_attention": 10, "lightning": 70}),
    ("minimax-m1-80k.json", 10 * 4096, 70 * 64 * 128 * 128 * 2, {"full_attention": 10, "lightning": 70}),
    # 62 × 2 × 8 × 128 × 2 B
    ("minimax-m2.json", 62 * 4096, 0, {"full_attention": 62}),
    # 10 global layers × 2 × 16 × 128 × 2 B grow; 52 local layers capped
    ("gemma-3-27b-it.json", 10 * 8192, 0, {"full_attention": 10, "sliding_attention": 52}),
    # every layer sliding (window 4096): no unbounded growth
    ("mistral-7b-v0.1.json", 0, 0, {"sliding_attention": 32}),
    ("mistral-7b-instruct-v0.3.json", 32 * 4096, 0, {"full_attention": 32}),
    # 4 attention × 4096 B; 28 mamba × (8192·4 + 8192·16) × 2 B
    ("jamba-v0.1.json", 4 * 4096, 28 * (8192 * 4 + 8192 * 16) * 2, {"full_attention": 4, "mamba": 28}),
    # 4 attention × 4096 B; 24 mamba2 × ((8192 + 2·8·128)·4 + 128·64·128) × 2 B; 24 MLP layers hold nothing
    ("nemotron-h-8b-base-8k.json", 4 * 4096, 24 * (10240 * 4 + 128 * 64 * 128) * 2,
     {"full_attention": 4, "mamba2": 24, "none": 24}),
    # 6 attention × 2 × 8 × 64 × 2 B; 10 short convs × 2048 × 3 × 2 B
    ("lfm2-1.2b.json", 6 * 2048, 10 * 2048 * 3 * 2, {"full_attention": 6, "short_conv": 10}),
]


@pytest.mark.parametrize(("name", "per_token", "fixed", "kinds"), CASES, ids=[c[0] for c in CASES])
def test_published_configs(name: str, per_token: int, fixed: int, kinds: dict[str, int]) -> None:
    p = plan(name)
    assert p.bytes_per_token == per_token
    assert p.fixed_bytes == fixed
    assert p.kind_counts() == kinds


def test_llama_totals_are_linear() -> None:
    p = plan("llama-3.1-8b-instruct.json")
    assert p.kv_bytes(8192) == 8192 * 131072 == 1024 * 2**20  # the well-known 1 GiB at 8K
    assert p.kv_bytes(0) == 0


def test_gemma3_sliding_layers_cap_at_window_minus_one() -> None:
    p = plan("gemma-3-27b-it.json")
    assert [layer.index for layer in p.layers if layer.kind == "full_attention"] == list(range(5, 62, 6))
    assert p.window_bytes == 52 * 8192 * 1023
    assert p.kv_bytes(8192) == 10 * 8192 * 8192 + 52 * 8192 * 1023
    assert p.kv_bytes(512) == 62 * 8192 * 512
    full = plan("gemma-3-27b-it.json", window_mode="full")
    assert full.kv_bytes(8192) == 10 * 8192 * 8192 + 52 * 8192 * 1024


def test_mistral_v01_all_sliding() -> None:
    p = plan("mistral-7b-v0.1.json")
    assert p.kv_bytes(100_000) == p.kv_bytes(4095) == 32 * 4096 * 4095
    assert p.kv_bytes(1000) == 32 * 4096 * 1000


def test_mla_layouts() -> None:
    assert plan("deepseek-v3.json", mla_layout="expanded").bytes_per_token == 61 * 128 * (192 + 128) * 2
    kimi = plan("kimi-linear-48b-a3b-instruct.json", mla_layout="expanded")
    assert kimi.bytes_per_token == 7 * 32 * (192 + 128) * 2


def test_dtypes_and_state_dtype() -> None:
    p32 = plan("qwen3-next-80b-a3b-instruct.json", dtype="float32")
    assert p32.bytes_per_token == 12 * 1024 * 4
    mixed = plan("qwen3-next-80b-a3b-instruct.json", dtype="fp8", state_dtype="float32")
    assert mixed.bytes_per_token == 12 * 1024
    assert mixed.fixed_bytes == 36 * (8192 * 4 + 524288) * 4
    int4 = plan("llama-3.1-8b-instruct.json", dtype="int4")
    assert int4.kv_bytes(3) == 32 * 2 * 8 * 128 * 3 // 2


def test_minimax_attn_type_list_positions() -> None:
    p = plan("minimax-text-01.json")
    assert [layer.index for layer in p.layers if layer.kind == "full_attention"] == list(range(7, 80, 8))


def test_kimi_layers_are_one_indexed() -> None:
    p = plan("kimi-linear-48b-a3b-instruct.json")
    assert [layer.index for layer in p.layers if layer.kind == "mla"] == [3, 7, 11, 15, 19, 23, 26]


def test_unknown_layer_type_names_the_field() -> None:
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "layer_types": ["full_attention", "mystery_attention"]}
    with pytest.raises(InvalidRequest, match=r"layer_types\[1\] = 'mystery_attention'"):
        plan_from_config(cfg)


def test_unknown_recurrent_family_names_model_type() -> None:
    cfg = {"model_type": "brand_new", "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
           "layer_types": ["linear_attention"]}
    with pytest.raises(InvalidRequest, match="model_type 'brand_new'"):
        plan_from_config(cfg)


def test_missing_field_is_named() -> None:
    with pytest.raises(InvalidRequest, match="'num_hidden_layers'"):
        plan_from_config({"model_type": "llama", "hidden_size": 64})
    with pytest.raises(InvalidRequest, match="hybrid_override_pattern"):
        plan_from_config({"model_type": "nemotron_h", "num_hidden_layers": 2, "hidden_size": 64,
                          "num_attention_heads": 4, "hybrid_override_pattern": "MX"})


def test_bad_options() -> None:
    with pytest.raises(InvalidRequest):
        plan("llama-3.2-1b.json", mla_layout="packed")
    with pytest.raises(InvalidRequest):
        plan("llama-3.2-1b.json", dtype="float12")
    with pytest.raises(InvalidRequest, match="no model config"):
        plan_from_path(FIX / "missing.json")


def test_per_layer_config_overrides() -> None:
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 4, "per_layer_config": {"1": {"num_key_value_heads": 1}}}
    p = plan_from_config(cfg, dtype="float32")
    assert [layer.bytes_per_token for layer in p.layers] == [2 * 4 * 16 * 4, 2 * 1 * 16 * 4]


def test_json_shape() -> None:
    out = plan("jamba-v0.1.json").to_json([1024, 8192])
    assert {"bytes_per_token", "fixed_bytes", "per_length", "layers"} <= set(out)
    assert out["per_length"][1] == {"seq_len": 8192, "kv_bytes": 8192 * 16384 + 28 * 327680}
    assert {"index", "kind", "bytes_per_token", "fixed_bytes", "window"} <= set(out["layers"][0])
