"""A Llama-family decoder layer on fewer, larger operators (CPU): merged projections and prfaas's layer kernels.

transformers runs a Llama layer as about sixty PyTorch operators; at a decode step's sizes each costs its dispatch
and a pass over its inputs more than its arithmetic, so a small model's step spends as much time between operators as
in its matmuls (``benchmarks/engine_profile.py``). ``fuse`` swaps, in place:

- every RMSNorm of the Llama formula (Llama, Mistral, Qwen2, Qwen3) for one ``prfaas::rms_norm``;
- every SiLU MLP of those models for one matmul over the gate and up projections merged, ``prfaas::silu_mul`` and
  the down projection (three matmuls and two operators before);
- every Llama attention layer for one matmul over the query, key and value projections merged and one
  ``prfaas::rotary`` (the rotary embedding was sixteen operators); the cache update, the attention call and the
  output projection stay as transformers runs them, so prfaas's decode attention and folded passes are unchanged.

The kernels follow transformers' arithmetic and roundings (``csrc/layers.cpp``); a merged projection's columns are
its parts' columns. Run after the weights' hash is taken and before ``pack``, which packs the merged linears; a
fused model's state dict still holds the plain projections, so it saves as a plain model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
ATTENTIONS = ("LlamaAttention",)


def merged(parts: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is ``parts``' outputs side by side."""
    bias = parts[0].bias is not None
    linear = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=bias,
                       dtype=parts[0].weight.dtype, device=parts[0].weight.device)
    with torch.no_grad():
        linear.weight.copy_(torch.cat([p.weight for p in parts]))
        if bias:
            linear.bias.copy_(torch.cat([p.bias for p in parts]))
    return linear


def _unmerge_on_save(module: nn.Module, merged_name: str, names: list[str], sizes: list[int]) -> None:
    """``module``'s state dict holds ``names``' weights (and biases) split from the merged linear's."""
    def hook(_: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for kind in ("weight", "bias"):
            tensor = state.pop(f"{prefix}{merged_name}.{kind}", None)
            if tensor is not None:
                for name, part in zip(names, tensor.split(sizes), strict=True):
                    state[f"{prefix}{name}.{kind}"] = part.clone()

    module._register_state_dict_hook(hook)


class FusedRMSNorm(nn.Module):
    """transformers' Llama RMSNorm as one ``prfaas::rms_norm``; the same ``weight`` and ``variance_epsilon``."""

    def __init__(self, norm: Any) -> None:
        super().__init__()
        self.weight: nn.Parameter = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype or hidden_states.device.type != "cpu":
            input_dtype = hidden_states.dtype  # transformers' formula, for what the kernel does not take
            states = hidden_states.to(torch.float32)
            states = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * states.to(input_dtype)
        out: torch.Tensor = torch.ops.prfaas.rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return out

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class FusedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` as ``down(silu_mul(gate_up(x)))``."""

    def __init__(self, mlp: Any) -> None:
        super().__init__()
        self.gate_up_proj = merged([mlp.gate_proj, mlp.up_proj])
        self.down_proj: nn.Module = mlp.down_proj
        _unmerge_on_save(self, "gate_up_proj", ["gate_proj", "up_proj"], [mlp.gate_proj.out_features] * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down: torch.Tensor = self.down_proj(torch.ops.prfaas.silu_mul(self.gate_up_proj(x)))
        return down


class FusedAttention(nn.Module):
    """transformers' ``LlamaAttention`` on one query/key/value matmul and ``prfaas::rotary``; the same attributes,
    cache update, attention interface and output projection."""

    def __init__(self, attention: Any) -> None:
        super().__init__()
        config = attention.config
        self.config: Any = config
        self.layer_idx: int = attention.layer_idx
        self.head_dim: int = attention.head_dim
        self.num_key_value_groups: int = attention.num_key_value_groups
        self.scaling: float = attention.scaling
        self.attention_dropout: float = attention.attention_dropout
        self.is_causal: bool = attention.is_causal
        self.heads: int = config.num_attention_heads
        self.kv_heads: int = config.num_key_value_heads
        sizes = [p.out_features for p in (attention.q_proj, attention.k_proj, attention.v_proj)]
        self.qkv_proj = merged([attention.q_proj, attention.k_proj, attention.v_proj])
        self.o_proj: nn.Module = attention.o_proj
        _unmerge_on_save(self, "qkv_proj", ["q_proj", "k_proj", "v_proj"], sizes)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        # Looked up once (transformers looks it up on every call); prfaas's ``attention.install`` has run by now.
        self.attend: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = \
            ALL_ATTENTION_FUNCTIONS[config._attn_implementation]

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache: Any = None, past_key_values: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = cache if cache is not None else past_key_values
        batch, seq = hidden_states.shape[:2]
        qkv = self.qkv_proj(hidden_states)
        cos, sin = position_embeddings
        query, key = torch.ops.prfaas.rotary(qkv, cos, sin, self.heads, self.kv_heads)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = qkv[..., (self.heads + self.kv_heads) * self.head_dim:] \
            .view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        out, weights = self.attend(self, query, key, value, attention_mask,
                                   dropout=0.0 if not self.training else self.attention_dropout,
                                   scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(batch, seq, -1).contiguous()), weights


def fuse(model: nn.Module) -> int:
    """Swap ``model``'s Llama-family RMSNorms, SiLU MLPs and Llama attention layers for their fused forms (CPU, with
    prfaas's kernels loaded: ``native.library()``); returns how many modules were swapped."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            kind, layer = type(child).__name__, cast(Any, child)
            if kind in RMS_NORMS:
                setattr(module, name, FusedRMSNorm(child))
            elif kind in MLPS and getattr(layer.config, "hidden_act", None) == "silu":
                setattr(module, name, FusedMLP(child))
            elif kind in ATTENTIONS and layer.config._attn_implementation == "sdpa":
                setattr(module, name, FusedAttention(child))
            else:
                continue
            swapped += 1
    return swapped
