"""Decode attention for grouped-query models on the CPU.

transformers hands a one-token query with no mask (every row of a batch at the same length) to
``scaled_dot_product_attention(..., enable_gqa=True)``; the CPU flash kernel is then about 5× slower than the same
kernel on the query packed as ``[batch, kv_heads, groups, dim]`` (the path transformers itself takes when a mask is
present). ``install`` makes every one-token query take the packed path, masked or not, so a row's attention is
computed the same way whether it decodes alone or in a batch; longer queries (prefill) go to transformers' SDPA
unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_installed = False


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    batch, heads, q_len, dim = query.shape
    plain = (q_len != 1 or groups == 1 or dropout or kwargs.get("position_bias") is not None
             or kwargs.get("softcap") is not None or kwargs.get("output_attentions")
             or (attention_mask is not None and attention_mask.shape[1] != 1))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    packed = query.reshape(batch, heads // groups, groups, dim)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def install() -> None:
    """Route transformers' ``sdpa`` attention through ``decode_attention`` (process-wide, idempotent)."""
    global _installed
    if _installed:
        return
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa", decode_attention)
    _installed = True
