"""Attention K/V of a decode batch held in place: one preallocated buffer per layer and tensor, grown by doubling.

A buffer is ``[row slots, heads, positions, dim]``. Rows occupy slots ``0 … rows-1``; every row's visible K/V end at
the same position ``end`` and span the layer's ``held`` positions before it (left padding, masked by the batch's
attention mask). A decode step writes the new token's K/V at ``end`` and moves ``end`` on, instead of concatenating
the whole cache as transformers' ``DynamicLayer`` does; ``layer.keys`` / ``layer.values`` stay views of the buffer,
so the model and the mask code see the usual shapes. Buffers are zero-filled when made and only ever receive K/V, so
padded positions hold finite values that the mask weights by exactly zero. Buffers made during a forward pass are
inference tensors, so every operation on them runs in inference mode.
"""

from __future__ import annotations

from typing import Any

import torch

_HEADROOM = 64  # positions appended between reallocations, at least (then doubling)
_GROWN: dict[type, type] = {}


def held(total: int, window: int | None) -> int:
    """K/V positions an attention layer holds for ``total`` tokens (a sliding layer keeps ``window - 1``)."""
    return total if window is None else min(total, window - 1)


def _window(layer: Any) -> int | None:
    window = getattr(layer, "sliding_window", None)
    return int(window) if window is not None else None


def _update(self: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
            **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    n, before, rows = key_states.shape[-2], self.keys.shape[-2], self.keys.shape[0]
    if self._prfaas_end + n > self._prfaas_k.shape[-2]:
        _reallocate(self, self._prfaas_k.shape[0], before)
    end = self._prfaas_end + n
    self._prfaas_k[:rows, :, end - n:end] = key_states
    self._prfaas_v[:rows, :, end - n:end] = value_states
    self._prfaas_end = end
    full_k, full_v = self._prfaas_k[:rows, :, end - before - n:end], self._prfaas_v[:rows, :, end - before - n:end]
    window = _window(self)
    if window is not None:
        self.cumulative_length += n
    keep = held(before + n, window)
    self.keys, self.values = full_k[:, :, before + n - keep:], full_v[:, :, before + n - keep:]
    return full_k, full_v


def _grown_class(cls: type) -> type:
    if cls not in _GROWN:
        _GROWN[cls] = type(f"InPlace{cls.__name__}", (cls,), {"update": _update})
    return _GROWN[cls]


def _reallocate(layer: Any, slots: int, end: int) -> None:
    """New zero buffers of ``slots`` rows with room past ``end``; the current rows' visible K/V are copied so
    that they end at ``end``."""
    rows, n = layer.keys.shape[0], layer.keys.shape[-2]
    length = end + max(_HEADROOM, end)
    for name, current in (("_prfaas_k", layer.keys), ("_prfaas_v", layer.values)):
        buf = current.new_zeros(slots, current.shape[1], length, current.shape[3])
        buf[:rows, :, end - n:end] = current
        setattr(layer, name, buf)
    layer._prfaas_end = end


def _view(layer: Any, rows: int, visible: int) -> None:
    end = layer._prfaas_end
    layer.keys = layer._prfaas_k[:rows, :, end - visible:end]
    layer.values = layer._prfaas_v[:rows, :, end - visible:end]


@torch.inference_mode()
def adopt(layer: Any, max_rows: int) -> None:
    """Move an attention layer's K/V into buffers and make its ``update`` write in place."""
    rows, n = layer.keys.shape[0], layer.keys.shape[-2]
    _reallocate(layer, min(max_rows, 2 * rows), n)
    layer.__class__ = _grown_class(type(layer))
    _view(layer, rows, n)


@torch.inference_mode()
def join(layer: Any, other: Any, target: int, other_length: int, max_rows: int) -> None:
    """Add ``other``'s single row in the next slot; every row then shows ``held(target)`` positions."""
    window = _window(layer)
    rows, visible, own = layer.keys.shape[0], held(target, window), held(other_length, window)
    slots = layer._prfaas_k.shape[0]
    if rows + 1 > slots or visible > layer._prfaas_end:
        _reallocate(layer, min(max_rows, max(rows + 1, 2 * slots)), visible)
    end = layer._prfaas_end
    layer._prfaas_k[rows, :, end - own:end] = other.keys[0, :, other.keys.shape[-2] - own:]
    layer._prfaas_v[rows, :, end - own:end] = other.values[0, :, other.values.shape[-2] - own:]
    if window is not None:
        layer.cumulative_length = target
    _view(layer, rows + 1, visible)


@torch.inference_mode()
def remove(layer: Any, slot: int, target: int) -> None:
    """Drop the row in ``slot`` (the last row moves into it); every remaining row then shows ``held(target)``."""
    rows, window, end, visible = layer.keys.shape[0], _window(layer), layer._prfaas_end, layer.keys.shape[-2]
    if slot != rows - 1:
        for buf in (layer._prfaas_k, layer._prfaas_v):
            buf[slot, :, end - visible:end] = buf[rows - 1, :, end - visible:end]
    if window is not None:
        layer.cumulative_length = target
    visible = held(target, window)
    _view(layer, rows - 1, visible)
    slots, length = layer._prfaas_k.shape[0], layer._prfaas_k.shape[-2]
    if length > 4 * (visible + _HEADROOM) or 4 * (rows - 1) < slots:  # give most of the memory back
        _reallocate(layer, max(1, 2 * (rows - 1)), visible)
        _view(layer, rows - 1, visible)


def nbytes(layer: Any) -> int:
    """Bytes of the layer's buffers (capacity, not just the visible part)."""
    return sum(t.nbytes for t in (getattr(layer, "_prfaas_k", None), getattr(layer, "_prfaas_v", None))
               if isinstance(t, torch.Tensor))
