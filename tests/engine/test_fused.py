from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from prfaas.engine import load_engine, native
from prfaas.engine.fused import MLPS, RMS_NORMS, FusedAttention, FusedMLP, FusedRMSNorm, fuse
from tests.conftest import random_prompt

pytestmark = pytest.mark.skipif(not native.library(), reason="prfaas's CPU kernels do not build here")
DTYPES = [torch.float32, torch.bfloat16]


def _random(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_follows_transformers_formula(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    norm.weight.data = _random(576, dtype=dtype, seed=1)
    x = _random(8, 3, 576, dtype=dtype, seed=2)
    ours, theirs = torch.ops.prfaas.rms_norm(x, norm.weight, 1e-5), norm(x)
    assert ours.dtype == dtype and ours.shape == x.shape
    if dtype == torch.float32:  # only the variance's summation order differs
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    else:  # the same roundings: at most one bfloat16 step apart, nearly always equal
        assert (ours.float() - theirs.float()).abs().max() <= theirs.float().abs().max() * 2 ** -7
        assert (ours == theirs).float().mean() > 0.99
    assert torch.equal(torch.ops.prfaas.rms_norm(x[2:3], norm.weight, 1e-5), ours[2:3])  # a row alone, the same


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_of_the_gate_times_the_up_half(dtype: torch.dtype) -> None:
    x = _random(5, 2, 2 * 96, dtype=dtype, seed=3)
    ours, theirs = torch.ops.prfaas.silu_mul(x), F.silu(x[..., :96]) * x[..., 96:]
    assert ours.shape == (5, 2, 96)
    torch.testing.assert_close(ours, theirs, rtol=1e-5 if dtype == torch.float32 else 2 ** -7, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cos_rows", [4, 1])
def test_rotary_gives_transformers_bits(dtype: torch.dtype, cos_rows: int) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    heads, kv_heads, dim, batch, seq = 6, 2, 16, 4, 5
    qkv = _random(batch, seq, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=4)
    cos, sin = (_random(cos_rows, seq, dim, dtype=dtype, seed=s) for s in (5, 6))
    q = qkv[..., : heads * dim].view(batch, seq, heads, dim).transpose(1, 2)
    k = qkv[..., heads * dim: (heads + kv_heads) * dim].view(batch, seq, kv_heads, dim).transpose(1, 2)
    theirs = apply_rotary_pos_emb(q, k, cos, sin)
    ours = torch.ops.prfaas.rotary(qkv, cos, sin, heads, kv_heads)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.transpose(1, 2), b)  # rounded where transformers' operators round


def test_the_kernels_refuse_what_they_cannot_compute() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight is"):
        torch.ops.prfaas.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        torch.ops.prfaas.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="equal width"):
        torch.ops.prfaas.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="heads"):
        torch.ops.prfaas.rotary(torch.randn(1, 2, 40), torch.randn(1, 2, 8), torch.randn(1, 2, 8), 2, 2)


def test_a_llama_engine_runs_fused_and_saves_as_a_plain_model() -> None:
    on, off = (load_engine("tiny-llama", kernels=k) for k in (True, False))
    layer = on.model.model.layers[0]
    assert isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedMLP)
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and isinstance(on.model.model.norm, FusedRMSNorm)
    assert not any(isinstance(m, FusedRMSNorm | FusedMLP | FusedAttention) for m in off.model.modules())
    theirs, ours = off.model.state_dict(), on.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    for seed in range(3):  # float32: the two agree to the last bits of a sum
        prompt = random_prompt(60, seed=seed)
        assert on.generate(prompt, 12) == off.generate(prompt, 12)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral"])
def test_other_llama_family_layers_take_the_fused_norm_and_mlp(model_type: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=512, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        plain = AutoModelForCausalLM.from_config(config).eval()
    fused = copy.deepcopy(plain)
    kinds = [type(m).__name__ for m in plain.modules()]
    assert fuse(fused) == sum(k in RMS_NORMS + MLPS for k in kinds) >= 2 * 2 + 1 + 2  # attention: Llama's only
    assert not any(type(m).__name__ in RMS_NORMS + MLPS for m in fused.modules())
    ids = torch.tensor([random_prompt(20, seed=1, vocab=512)])
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
