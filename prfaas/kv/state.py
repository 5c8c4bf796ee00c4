"""``KVState``: the per-request model state that prefill hands to decode, engine-neutral (numpy only).

Each layer records its kind and whether it grows with the sequence, so the planner and the scheduler can read sizes
off it without knowing the model. ``attrs`` holds the small scalar bookkeeping a cache layer needs to be restored
exactly (a sliding window's cumulative length, a convolution's kernel size, …).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prfaas.kv.fingerprint import Fingerprint

# Layer kinds. Growing kinds hold K/V per token; the others hold a fixed-size state per request.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
MLA = "mla"
LINEAR_ATTENTION = "linear_attention"
MAMBA = "mamba"
CONV = "conv"
CACHE_STATE = "cache_state"  # model-level state outside the per-layer cache (MiniMax lightning attention)
NONE = "none"  # a layer with nothing cached (MLP/MoE-only layers, shared-KV consumers)
LAYER_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION, MLA, LINEAR_ATTENTION, MAMBA, CONV, CACHE_STATE, NONE)
ATTENTION_KINDS = frozenset({FULL_ATTENTION, SLIDING_ATTENTION, MLA})
DEFAULT_CHUNK_BYTES = 1024 * 1024
POSITIONAL = frozenset({"keys", "values", "indexer_keys"})  # attention tensors with one entry per held position


@dataclass(frozen=True)
class PrefixRef:
    """The cached prefix a suffix-only blob extends (``prfaas.kv.suffix``): the chain hash of the prefix's last
    block (``prfaas.kv.prefix``, 32 hex digits, salted as the decode instance salts) and its length in tokens (a
    block boundary). The blob holds the attention layers' positions from there on and every other layer whole."""

    chain_hash: str
    tokens: int

    def to_wire(self) -> dict[str, Any]:
        return {"chain_hash": self.chain_hash, "tokens": self.tokens}


@dataclass
class LayerState:
    index: int
    kind: str
    grows: bool
    window: int | None = None
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def table_entry(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "grows": self.grows, "window": self.window}

    def role(self, name: str) -> str:
        """How a codec treats a tensor: attention keys per channel, values per token, everything else a state."""
        if self.kind in ATTENTION_KINDS and name in ("keys", "indexer_keys"):
            return "key"
        if self.kind in ATTENTION_KINDS and name == "values":
            return "value"
        return "state"


@dataclass
class KVState:
    """The KV cache of one sequence after ``seq_len`` tokens, plus what is needed to restore it.

    ``cache`` names the engine's cache class so a restore can refuse a layout it does not know.
    ``first_token`` travels in the blob trailer; ``codec`` says which codec this state was decoded from.
    With ``prefix``, ``seq_len`` is still the whole prompt's but the attention layers hold only the positions after
    the prefix (``prfaas.kv.suffix.join`` puts the prefix back).
    """

    fingerprint: Fingerprint
    seq_len: int
    layers: list[LayerState]
    cache: str = "DynamicCache"
    first_token: int | None = None
    kv_id: str | None = None
    codec: str = "none"
    prefix: PrefixRef | None = None  # a suffix-only state: what it extends (None: the whole prompt's)

    @property
    def nbytes(self) -> int:
        """Raw tensor bytes (codec ``none``, no headers)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def fixed_bytes(self) -> int:
        """Bytes that do not depend on the sequence length (linear, SSM, conv and cache-level states)."""
        return sum(layer.nbytes for layer in self.layers if not layer.grows)
