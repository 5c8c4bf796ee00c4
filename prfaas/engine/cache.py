"""transformers cache ↔ ``KVState``: snapshot each cache layer generically, restore it exactly.

A layer's tensors (``keys``, ``values``, ``conv_states[i]``, ``recurrent_states[i]``, …) become numpy arrays;
its small bookkeeping (cumulative length, kernel sizes, flags) goes into ``attrs``; its class name is kept so a
restore refuses a layout it was not made for. Model-level state (MiniMax's ``linear_cache``) rides on the layer
it belongs to.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch

from prfaas.errors import KVIncompatible
from prfaas.kv import state as kinds
from prfaas.kv.state import POSITIONAL, LayerState

MAMBA_FAMILY = frozenset({"bamba", "jamba", "nemotron_h", "falcon_h1", "mamba", "mamba2", "granitemoehybrid"})
_SKIP = frozenset({"device", "_sliding_window_tensor"})
_CLASS = "__class__"


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_torch(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A copy: decode updates linear and conv states in place, and the ``KVState`` must stay as it was."""
    a = a.copy()
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(a).to(device)


def classify(layer: Any, model_type: str, is_mla: bool, has_cache_state: bool) -> tuple[str, bool, int | None]:
    """(kind, grows, window) of one cache layer."""
    name = type(layer).__name__
    if has_cache_state:
        return kinds.CACHE_STATE, False, None
    if name == "DummyLayer" or (name == "DynamicLayer" and not layer.is_initialized):
        return kinds.NONE, False, None
    if hasattr(layer, "sliding_window") and "Sliding" in name:
        return kinds.SLIDING_ATTENTION, False, int(layer.sliding_window)
    if hasattr(layer, "keys"):
        return (kinds.MLA if is_mla else kinds.FULL_ATTENTION), True, None
    if not any(layer.is_recurrent_states_initialized.values()):
        return kinds.CONV, False, None
    return (kinds.MAMBA if model_type in MAMBA_FAMILY else kinds.LINEAR_ATTENTION), False, None


def snapshot_layer(cache: Any, index: int, model_type: str, is_mla: bool) -> LayerState:
    """The state of cache layer ``index`` as numpy (sharing memory with the cache where it can)."""
    layer = cache.layers[index] if index < len(cache.layers) else None
    cache_state = _cache_level_state(cache, index)
    tensors: dict[str, np.ndarray] = {}
    attrs: dict[str, Any] = {_CLASS: type(layer).__name__}
    if layer is not None:
        for attr, value in vars(layer).items():
            if attr not in _SKIP:
                _snapshot_attr(attr, value, tensors, attrs)
    if cache_state is not None:
        tensors["linear_cache"] = to_numpy(cache_state)
    kind, grows, window = classify(layer, model_type, is_mla, cache_state is not None)
    return LayerState(index=index, kind=kind, grows=grows, window=window, tensors=tensors, attrs=attrs)


def _snapshot_attr(attr: str, value: Any, tensors: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
    if isinstance(value, torch.Tensor):
        tensors[attr] = to_numpy(value)
    elif isinstance(value, torch.dtype):
        attrs[attr] = str(value).removeprefix("torch.")
    elif isinstance(value, dict):
        plain = {}
        for key, item in value.items():
            if isinstance(item, torch.Tensor):
                tensors[f"{attr}.{key}"] = to_numpy(item)
            else:
                plain[key] = item
        attrs[attr] = plain
    elif value is None or isinstance(value, bool | int | float | str):
        attrs[attr] = value


def _cache_level_state(cache: Any, index: int) -> torch.Tensor | None:
    linear = getattr(cache, "linear_cache", None)
    if linear is None or index >= len(linear) or not isinstance(linear[index], torch.Tensor):
        return None
    return linear[index]


def restore_layer(cache: Any, state: LayerState, device: torch.device) -> None:
    """Write ``state`` into a fresh ``cache`` (made by the engine for the same model)."""
    expected = state.attrs.get(_CLASS)
    while expected != "NoneType" and len(cache.layers) <= state.index and cache.layer_class_to_replicate:
        cache.layers.append(cache.layer_class_to_replicate())
    layer = cache.layers[state.index] if state.index < len(cache.layers) else None
    if type(layer).__name__ != expected:
        raise KVIncompatible(f"layer {state.index} is a {expected} in the KV but a {type(layer).__name__} here")
    for attr, value in state.attrs.items():
        if attr == _CLASS:
            continue
        if isinstance(getattr(layer, attr, None), dict):
            getattr(layer, attr).update(value)
        elif attr == "dtype":
            setattr(layer, attr, getattr(torch, str(value)))
        else:
            setattr(layer, attr, value)
    if layer is not None and hasattr(layer, "device"):
        layer.device = device
    for name, array in state.tensors.items():
        tensor = to_torch(array, device)
        if name == "linear_cache":
            cache.set_linear_cache(state.index, tensor)
        elif "." in name:
            attr, key = name.split(".", 1)
            getattr(layer, attr)[int(key)] = tensor
        else:
            setattr(layer, name, tensor)




def snapshot_rows(cache: Any, index: int, lengths: list[int], model_type: str, is_mla: bool) -> list[LayerState]:
    """Layer ``index`` of a left-padded batch cache, one ``LayerState`` per row holding only that row's tokens."""
    whole = snapshot_layer(cache, index, model_type, is_mla)
    rows = []
    for row, length in enumerate(lengths):
        tensors = {}
        for name, array in whole.tensors.items():
            part = array[row:row + 1]
            if name in POSITIONAL and whole.kind in kinds.ATTENTION_KINDS:
                keep = length if whole.window is None else min(length, whole.window - 1)
                part = part[..., part.shape[-2] - keep:, :]
            tensors[name] = np.ascontiguousarray(part)
        attrs = dict(whole.attrs)
        if "cumulative_length" in attrs:
            attrs["cumulative_length"] = length
        rows.append(LayerState(index=index, kind=whole.kind, grows=whole.grows, window=whole.window,
                               tensors=tensors, attrs=attrs))
    return rows
