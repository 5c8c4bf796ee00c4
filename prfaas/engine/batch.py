"""Continuous batching for decode: one forward pass per step over every running sequence.

Layout: pad and mask. All rows share one model cache in a common index space of ``length`` positions; a row
shorter than ``length`` is left-padded and its padding is masked out by the 2-D attention mask. Attention K/V
(full, MLA, sliding window) live in preallocated per-layer buffers that a step writes in place (``slots.py``);
fixed-size states (linear attention, SSM, convolution, MiniMax's cache-level state) are simply stacked. Rows join
at any step (into the next free slot) and leave at any step (the last row moves into the freed slot, and padding
every remaining row shares is trimmed).

Each row keeps its own positions, sampling and step counter, so its tokens do not depend on what else runs: they
equal its monolithic run except where floating-point differences of batched kernels meet a near-tie (CONTRACTS:
counted and reported by the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prfaas.engine import slots
from prfaas.engine.protocol import Engine
from prfaas.engine.sampling import pick_tokens
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

    def __init__(self, engine: Engine, max_batch: int) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.rows: list[Row] = []
        self.cache: Any = None
        self.length = 0
        self.stepped: dict[str, int] | None = None  # the last step's tokens

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
            for layer in self.cache.layers:
                if _attention(layer):
                    slots.adopt(layer, self.max_batch)
        else:
            target = max(self.length, row.length)
            for mine, theirs in zip(self.cache.layers, cache.layers, strict=False):
                if _attention(mine):
                    slots.join(mine, theirs, target, row.length, self.max_batch)
                _join_states(mine, theirs)
            _join_cache_state(self.cache, cache)
            self.length = target
        self.rows.append(row)

    def remove(self, seq_id: str) -> None:
        """The row leaves; the last row moves into its slot, and padding every remaining row shares goes."""
        slot = next((i for i, r in enumerate(self.rows) if r.seq_id == seq_id), None)
        if slot is None:
            return
        last = len(self.rows) - 1
        self.rows[slot] = self.rows[last]
        self.rows.pop()
        if not self.rows:
            self.cache, self.length = None, 0
            return
        order = list(range(last))
        if slot != last:
            order[slot] = last
        index = torch.tensor(order, device=self.engine.device)
        self.length = max(r.length for r in self.rows)
        with torch.inference_mode():  # the cache's tensors are inference tensors: updated in place only in this mode
            for layer in self.cache.layers:
                if _attention(layer):
                    slots.remove(layer, slot, self.length)
            _select_states(self.cache, index)

    def step(self) -> dict[str, int]:
        """One forward pass; returns each row's new token (rows stay in the batch until removed)."""
        return self.advance(self.engine.forward_rows(*self.inputs(), self.cache))

    def inputs(self) -> tuple[list[int], list[int], torch.Tensor]:
        """The next step's token and position of each row, and the mask over ``length + 1`` positions (a row's
        left padding masked)."""
        mask = torch.ones(len(self.rows), self.length + 1, dtype=torch.long, device=self.engine.device)
        for i, row in enumerate(self.rows):
            mask[i, :self.length - row.length] = 0
        return [r.token for r in self.rows], [r.length for r in self.rows], mask

    def advance(self, logits: torch.Tensor) -> dict[str, int]:
        """The step's end (``step``'s, or a prefill pass's that carried the rows): each row's token from its row
        of ``logits``, every row one position on. Also kept as ``stepped`` for whoever let a pass carry the rows."""
        out = {}
        tokens = pick_tokens(logits, [r.sampling for r in self.rows], [r.step for r in self.rows])
        for row, token in zip(self.rows, tokens, strict=True):
            out[row.seq_id] = token
            row.token, row.length, row.step = token, row.length + 1, row.step + 1
        self.length += 1
        self.stepped = out
        return out

    def kv_bytes(self) -> int:
        """Bytes the batched cache really holds: attention buffers at their capacity, padding included."""
        if self.cache is None:
            return 0
        total = 0
        for layer in self.cache.layers:
            total += slots.nbytes(layer)
            for name, value in vars(layer).items():
                if name in ("keys", "values") or name.startswith("_prfaas"):
                    continue
                tensors = value.values() if isinstance(value, dict) else [value]
                total += sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
        linear = getattr(self.cache, "linear_cache", [])
        return total + sum(t.nbytes for t in linear if isinstance(t, torch.Tensor))


def _attention(layer: Any) -> bool:
    return getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", False)


def _join_states(layer: Any, other: Any) -> None:
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


def _select_states(cache: Any, index: torch.Tensor) -> None:
    for layer in cache.layers:
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
