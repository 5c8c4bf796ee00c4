"""Continuous batching for decode: one forward pass per step over every running sequence.

Layout: pad and mask. All rows share one model cache in a common index space of ``length`` positions; a row
shorter than ``length`` is left-padded and its padding is masked out by the 2-D attention mask. Attention K/V
(full, MLA, sliding window) are padded on the left; fixed-size states (linear attention, SSM, convolution,
MiniMax's cache-level state) are simply stacked. Rows join at any step (the newcomer or the batch is padded) and
leave at any step (their rows are dropped, and padding every remaining row shares is trimmed).

Each row keeps its own positions, sampling and step counter, so its tokens do not depend on what else runs: they
equal its monolithic run except where floating-point differences of batched kernels meet a near-tie (CONTRACTS:
counted and reported by the tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from prfaas.engine.engine import pick_token
from prfaas.messages import SamplingParams


@dataclass
class Row:
    seq_id: str
    length: int  # true tokens in the cache for this row
    token: int  # the next token to feed
    sampling: SamplingParams | None
    step: int  # sampling step of the token the next forward produces


class DecodeBatch:
    """Not thread-safe: one engine thread owns it."""

    def __init__(self, engine: Any, max_batch: int) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.rows: list[Row] = []
        self.cache: Any = None
        self.length = 0

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def full(self) -> bool:
        return len(self.rows) >= self.max_batch

    def add(self, row: Row, cache: Any) -> None:
        """Join ``row`` whose own single-sequence ``cache`` holds ``row.length`` tokens."""
        if self.full:
            raise RuntimeError("the decode batch is full")
        if self.cache is None:
            self.cache, self.length = cache, row.length
        else:
            target = max(self.length, row.length)
            _each_layer(self.cache, cache, lambda a, b, sw: _join(a, b, self.length, row.length, target, sw))
            _join_cache_state(self.cache, cache)
            self.length = target
        self.rows.append(row)

    def remove(self, seq_id: str) -> None:
        keep = [i for i, r in enumerate(self.rows) if r.seq_id != seq_id]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache, self.length = None, 0
            return
        index = torch.tensor(keep, device=self.engine.device)
        _select(self.cache, index)
        shared_pad = self.length - max(r.length for r in self.rows)
        if shared_pad:
            _each_layer(self.cache, None, lambda a, _, sw: _trim(a, self.length - shared_pad, sw))
            self.length -= shared_pad

    def step(self) -> dict[str, int]:
        """One forward pass; returns each row's new token (rows stay in the batch until removed)."""
        device = self.engine.device
        pads = [self.length - r.length for r in self.rows]
        mask = torch.ones(len(self.rows), self.length + 1, dtype=torch.long, device=device)
        for i, pad in enumerate(pads):
            mask[i, :pad] = 0
        logits = self.engine.forward_rows([r.token for r in self.rows], [r.length for r in self.rows], mask,
                                          self.cache)
        out = {}
        for i, row in enumerate(self.rows):
            token = pick_token(logits[i], row.sampling, row.step)
            out[row.seq_id] = token
            row.token, row.length, row.step = token, row.length + 1, row.step + 1
        self.length += 1
        return out

    def kv_bytes(self) -> int:
        """Bytes the batched cache really holds, padding included."""
        total = 0
        for layer in getattr(self.cache, "layers", []) if self.cache is not None else []:
            for value in vars(layer).values():
                tensors = value.values() if isinstance(value, dict) else [value]
                total += sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
        linear = getattr(self.cache, "linear_cache", []) if self.cache is not None else []
        return total + sum(t.nbytes for t in linear if isinstance(t, torch.Tensor))


def _each_layer(cache: Any, other: Any, fn: Callable[[Any, Any, int | None], None]) -> None:
    for i, layer in enumerate(cache.layers):
        fn(layer, other.layers[i] if other is not None else None, getattr(layer, "sliding_window", None))


def _attention(layer: Any) -> bool:
    return getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", False)


def _held(total: int, window: int | None) -> int:
    """K/V positions an attention layer holds for ``total`` tokens (a sliding layer keeps ``window - 1``)."""
    return total if window is None else min(total, window - 1)


def _pad_to(t: torch.Tensor, n: int) -> torch.Tensor:
    return F.pad(t, (0, 0, n - t.shape[-2], 0)) if t.shape[-2] < n else t[..., t.shape[-2] - n:, :]


def _join(layer: Any, other: Any, length: int, other_length: int, target: int, window: int | None) -> None:
    if _attention(layer):
        n = _held(target, window)
        layer.keys = torch.cat([_pad_to(layer.keys, n), _pad_to(other.keys, n)])
        layer.values = torch.cat([_pad_to(layer.values, n), _pad_to(other.values, n)])
        if window is not None:
            layer.cumulative_length = target
    for name in ("conv_states", "recurrent_states"):
        states = getattr(layer, name, None)
        if isinstance(states, dict):
            for key, value in states.items():
                if isinstance(value, torch.Tensor):
                    states[key] = torch.cat([value, getattr(other, name)[key]])


def _join_cache_state(cache: Any, other: Any) -> None:
    linear = getattr(cache, "linear_cache", None)
    if linear is not None:
        for i, value in enumerate(linear):
            if isinstance(value, torch.Tensor):
                linear[i] = torch.cat([value, other.linear_cache[i]])


def _select(cache: Any, index: torch.Tensor) -> None:
    for layer in cache.layers:
        if _attention(layer):
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None)
            if isinstance(states, dict):
                for key, value in states.items():
                    if isinstance(value, torch.Tensor):
                        states[key] = value[index]
    linear = getattr(cache, "linear_cache", None)
    if linear is not None:
        for i, value in enumerate(linear):
            if isinstance(value, torch.Tensor):
                linear[i] = value[index]


def _trim(layer: Any, target: int, window: int | None) -> None:
    if _attention(layer):
        n = _held(target, window)
        layer.keys, layer.values = _pad_to(layer.keys, n), _pad_to(layer.values, n)
        if window is not None:
            layer.cumulative_length = target
