"""Decode attention for grouped-query models on the CPU, and the attention kernels a GPU may use.

transformers hands a one-token query with no mask (every row of a batch at the same length) to
``scaled_dot_product_attention(..., enable_gqa=True)``; the CPU flash kernel is then about 5× slower than the same
kernel on the query packed as ``[batch, kv_heads, groups, dim]`` (the path transformers itself takes when a mask is
present). ``install`` makes every one-token query take the packed path, masked or not, so a row's attention is
computed the same way whether it decodes alone or in a batch; longer queries (prefill) go to transformers' SDPA
unchanged.

A *folded* pass (``Fold``, passed to the model as the ``prfaas_fold`` keyword with no model cache) packs one
sequence's prefill chunk and one token of every decode row into one row of queries: the linears read the weights once
for both. Its attention splits the packed K/V: the chunk's go into the prefill cache and attend causally to it, each
decode row's go into the decode batch's in-place buffers and attend to its own row there, each with the mask the
model itself would have built for that part.

On a GPU every call runs without cuDNN's attention kernel: given a mask, as every decode step and folded pass is,
PyTorch picks it, and it spent milliseconds of host time per call building a plan for each new key length — more
than the rest of a small model's step (docs/engine.md, "On a GPU"). The memory-efficient and flash kernels (math as a
last resort) take the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_installed = False
KERNEL = "prfaas_decode_kernel"  # the attributes ``use_kernel`` sets on an attention layer
PREFILL_KERNEL = "prfaas_prefill_kernel"
_GPU_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class Fold:
    """One folded pass: the first ``chunk`` packed tokens are a prefill chunk on ``prefill`` (a model cache), the
    rest one token per row of ``rows`` (a decode batch's cache); each part's mask as the model builds it."""

    chunk: int
    prefill: Any
    prefill_mask: torch.Tensor | None
    rows: Any
    rows_mask: torch.Tensor | None


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    if query.is_cuda:
        with sdpa_kernel(_GPU_KERNELS):
            return _attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    return _attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, is_causal: bool | None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fold = kwargs.pop("prfaas_fold", None)
    if fold is not None:
        return _folded(module, query, key, value, fold, scaling, **kwargs)

    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    batch, heads, q_len, dim = query.shape
    plain = (q_len != 1 or groups == 1 or dropout or kwargs.get("position_bias") is not None
             or kwargs.get("softcap") is not None or kwargs.get("output_attentions")
             or (attention_mask is not None and attention_mask.shape[1] != 1))
    if plain:
        prefill = getattr(module, PREFILL_KERNEL, None)
        if prefill is not None and q_len > 1:
            causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
            mask = _prefill_mask(query, key, value, attention_mask, causal, dropout, kwargs)
            if mask is not False:
                scale = dim ** -0.5 if scaling is None else scaling
                return prefill(query, key, value, mask, causal and mask is None, scale), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    packed = query.reshape(batch, heads // groups, groups, dim)
    kernel = getattr(module, KERNEL, None)
    if kernel is not None and _fits(packed, key, value, attention_mask):
        rows_mask = None if attention_mask is None else attention_mask[:, 0, 0, :]
        out = kernel(packed, key, value, rows_mask, dim ** -0.5 if scaling is None else scaling)
    else:
        out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_kernel(model: torch.nn.Module, kernel: Any, prefill: Any = None) -> int:
    """Let ``model``'s attention layers run one-token queries on ``kernel`` (``native.decode_attention``, on the
    CPU) and longer ones on ``prefill`` (``native.prefill_attention``) where they fit them; returns how many layers
    they were given to."""
    given = 0
    for module in model.modules():
        if hasattr(module, "num_key_value_groups"):
            setattr(module, KERNEL, kernel)
            if prefill is not None:
                setattr(module, PREFILL_KERNEL, prefill)
            given += 1
    return given


def _prefill_mask(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  causal: bool, dropout: float, kwargs: dict[str, Any]) -> torch.Tensor | bool | None:
    """The prefill kernel's mask for this call: None (no mask: causal, or every key), a bool ``[batch, queries,
    keys]`` view of transformers' mask, or False where the kernel does not take the call (SDPA does): not CPU
    tensors of one dtype with contiguous rows, dropout or a score modifier, a float mask, or causal without a mask
    over a query shorter than its keys (SDPA's causal is aligned to the first key there)."""
    from prfaas.engine.native import MAX_HEAD_DIM

    if dropout or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "sliding_window", "s_aux")):
        return False
    if kwargs.get("output_attentions") or query.device.type != "cpu" or query.shape[-1] > MAX_HEAD_DIM:
        return False
    if not query.dtype == key.dtype == value.dtype or any(t.stride(-1) != 1 for t in (query, key, value)):
        return False
    if key.shape[1] == 0 or query.shape[1] % key.shape[1] or value.shape != key.shape:
        return False
    if mask is None:
        return None if not causal or query.shape[2] == key.shape[2] else False
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] < key.shape[-2]:
        return False
    if mask.shape[0] not in (1, query.shape[0]) or mask.shape[2] != query.shape[2]:
        return False
    return mask[:, 0, :, : key.shape[-2]].expand(query.shape[0], -1, -1)


def _fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """The kernel takes this call: CPU tensors of one dtype, a head dim it takes, rows' last dimension
    contiguous, and no mask or a boolean one per row over the keys (what transformers builds for a decode step)."""
    from prfaas.engine.native import MAX_HEAD_DIM

    if query.device.type != "cpu" or query.shape[-1] > MAX_HEAD_DIM or value.shape[-1] != query.shape[-1]:
        return False
    if not query.dtype == key.dtype == value.dtype or any(t.stride(-1) != 1 for t in (query, key, value)):
        return False
    return mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1
                            and mask.shape[0] == query.shape[0] and mask.shape[-1] == key.shape[-2])


def _folded(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, fold: Fold,
            scaling: float | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``query`` / ``key`` / ``value`` are ``[1, heads, chunk + rows, dim]``: the chunk's part as a prefill pass
    computes it, the rows' part as a decode step does (the same functions on the same caches and masks)."""
    index, n = module.layer_idx, fold.chunk
    keys, values = fold.prefill.update(key[:, :, :n], value[:, :, :n], index)
    chunk, _ = _attention(module, query[:, :, :n], keys, values, fold.prefill_mask, 0.0, scaling, None, **kwargs)
    keys, values = fold.rows.update(key[:, :, n:].transpose(0, 2), value[:, :, n:].transpose(0, 2), index)
    rows, _ = _attention(module, query[:, :, n:].transpose(0, 2), keys, values, fold.rows_mask, 0.0, scaling, None,
                         **kwargs)
    return torch.cat([chunk, rows.transpose(0, 1)], dim=1), None


def install() -> None:
    """Route transformers' ``sdpa`` attention through ``decode_attention`` (process-wide, idempotent)."""
    global _installed
    if _installed:
        return
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa", decode_attention)
    _installed = True
