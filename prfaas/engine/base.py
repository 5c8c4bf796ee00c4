"""``EngineBase``: what the transformers engine and the synthetic engine share, on top of the passes each
implements (``prefill_cache``, ``prefill_chunks``, ``prefill_batch``, ``snapshot``, ``restore``, ``stream``,
``forward_rows``): prompt checks, ``prefill`` into a ``KVState``, ``decode`` from one, and the KV footprint and
layer table measured from tiny prefills. Both satisfy the ``Engine`` protocol (``protocol.py``).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from prfaas.engine.protocol import ChunkPlan, ChunkResult, LayerCallback, PrefillOutput, Riders, RowCallback
from prfaas.errors import InvalidRequest
from prfaas.kv import Fingerprint, KVState
from prfaas.messages import SamplingParams


class EngineBase(ABC):
    """A loaded model with its tokenizer and compatibility fingerprint. Not thread-safe: one caller at a time."""

    keeps_kv = True  # restore() needs the KV bytes (a synthetic engine needs only their sizes)
    config: Any  # the model's (text) config: ``vocab_size``, ``model_type``, ``to_dict()``

    def __init__(self, name: str, tokenizer: Any, fingerprint: Fingerprint, eos_token_ids: tuple[int, ...],
                 vocab_size: int, device: torch.device, root: str = "") -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.max_seq_len = fingerprint.max_seq_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.device = device
        self.root = root  # where the tokenizer loads from, which load tools read; "" where there is none

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    @property
    @abstractmethod
    def cache_class(self) -> str: ...

    @functools.cached_property
    def kv_footprint(self) -> tuple[int, int]:
        """(fixed bytes, bytes per token) of one sequence's KV, measured from two tiny prefills."""
        one, two = (self.prefill([0] * n).kv.nbytes for n in (1, 2))
        return one - (two - one), two - one

    @functools.cached_property
    def layer_table(self) -> tuple[dict[str, Any], ...]:
        """Kind, growth and window of every layer, known before a prompt runs (a blob header needs it)."""
        return tuple(layer.table_entry() for layer in self.prefill([0]).kv.layers)

    def check_prompt(self, token_ids: Sequence[int]) -> list[int]:
        """The prompt as ints, or ``INVALID_REQUEST`` (empty, too long for the context, ids outside the vocab)."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if len(ids) > self.max_seq_len:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; this model's context is {self.max_seq_len}")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequest(f"token ids must be in [0, {self.vocab_size})")
        return ids

    def prefill(self, token_ids: Sequence[int], on_layer: LayerCallback | None = None,
                sampling: SamplingParams | None = None) -> PrefillOutput:
        """Run the prompt; ``on_layer`` receives each layer's state as soon as that layer has run."""
        cache, next_token, seconds = self.prefill_cache(token_ids, on_layer, sampling)
        kv = self.snapshot(cache, len(token_ids), first_token=next_token)
        return PrefillOutput(kv=kv, next_token=next_token, seconds=seconds)

    def decode(self, kv: KVState, next_token: int, max_new_tokens: int = 16,
               sampling: SamplingParams | None = None) -> list[int]:
        """Tokens that follow ``next_token`` (greedy by default); stops after an EOS (included) or
        ``max_new_tokens``."""
        return list(self.stream(self.restore(kv), next_token, kv.seq_len, max_new_tokens, sampling))

    @abstractmethod
    def prefill_cache(self, token_ids: Sequence[int], on_layer: LayerCallback | None = None,
                      sampling: SamplingParams | None = None, step: int = 0) -> ChunkResult:
        """Like ``prefill`` but keeps the live model cache (for decoding in the same process)."""

    @abstractmethod
    def prefill_chunks(self, token_ids: Sequence[int], chunk: int | ChunkPlan,
                       sampling: SamplingParams | None = None, step: int = 0,
                       on_layer: LayerCallback | None = None) -> Iterator[ChunkResult | None]:
        """Prefill ``chunk`` tokens per forward pass (0: one pass; a ``ChunkPlan``: as it says before each pass),
        yielding ``None`` between chunks (so a scheduler can run other work in between) and finally
        ``(cache, next_token, seconds)``; ``on_layer`` receives each layer's whole state during the last chunk."""

    @abstractmethod
    def prefill_batch(self, prompts: Sequence[Sequence[int]], on_layer: RowCallback | None = None,
                      samplings: Sequence[SamplingParams | None] | None = None) -> tuple[list[int], float]:
        """Several prompts in one forward pass: each one's first token, and the seconds."""

    @abstractmethod
    def snapshot(self, cache: Any, seq_len: int, first_token: int | None = None) -> KVState:
        """The ``KVState`` of a live cache holding ``seq_len`` tokens."""

    @abstractmethod
    def restore(self, kv: KVState) -> Any:
        """A fresh model cache holding ``kv``; ``KV_INCOMPATIBLE`` names every mismatching fingerprint field."""

    @abstractmethod
    def new_cache(self) -> Any:
        """An empty model cache."""

    @abstractmethod
    def stream(self, cache: Any, next_token: int, position: int, max_new_tokens: int,
               sampling: SamplingParams | None = None, step: int = 1) -> Iterator[int]:
        """Yield tokens one by one from a live cache holding ``position`` tokens (``next_token`` not yet fed);
        ``step`` numbers the first yielded token for seeded sampling."""

    @abstractmethod
    def forward_rows(self, tokens: list[int], positions: list[int], mask: torch.Tensor, cache: Any) -> torch.Tensor:
        """One decode step for a batch: one token per row at its own position; float32 logits [rows, vocab]."""

    folds = False  # a prefill pass cannot carry decode rows unless an engine says so

    def carry(self, rows: Riders | None) -> None:
        """Ignored where the engine does not fold decode rows into its prefill passes."""
        return None

    @abstractmethod
    def generate(self, token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Monolithic reference: greedy, prompt excluded (first token included)."""

    @abstractmethod
    def continuation_logits(self, kv: KVState, tokens: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits (float32, one row per token) after feeding ``tokens`` on top of ``kv``."""
